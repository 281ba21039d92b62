"""Dilated convolution (nn.Conv2d / Conv1d / F.conv2d with dilation > 1, stride 1) as plain
convolutions over the input's phases.

With dilation d along an axis and the input zero-padded to a multiple of d, output i = i' d + u
reads padded inputs (i' + a) d + u for the kernel's a: a plain convolution of phase u of the
input (its elements u, u + d, u + 2d, ...) with the same weight, whose outputs are phase u of
the result. So the input is seen as (..., size / d, d) per dilated axis and sliced into its
d_h d_w phases, each phase convolved with the layer's weight and bias (one parameter read by
d_h d_w convolutions: shared weights, whose gradients param_grad_sum adds, docs/numerics.md
§7c), and the phases interleaved back and cropped to torch's output size. The work is the
dilated convolution's; each phase is compacted on its own, and the interleaving aligns them to
one exponent. With a stride s as well (SKNet's dilated path), the stride-1 result is
subsampled (every s-th row and column): s^2 times the work of those layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mexc.errors import UnsupportedOpError
from mexc.ir import Value
from mexc.ops.tensor import interleaved, padded, reshaped, sliced

Conv = Callable[[Value, tuple[int, ...]], Value]  # a phase (N, C, H, W) -> its convolution


def dilated_size(
    shape: tuple[int, ...],
    kernel: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[int, int]:
    """(OH, OW) of the stride-1 dilated convolution of an (N, C, H, W) input."""
    return (
        shape[2] + 2 * padding[0] - dilation[0] * (kernel[0] - 1),
        shape[3] + 2 * padding[1] - dilation[1] * (kernel[1] - 1),
    )


def dilated_conv(
    c: Any,
    n: Any,
    x: Value,
    shape: tuple[int, ...],
    kernel: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    out_channels: int,
    conv: Conv,
) -> Value:
    """The stride-1 convolution of x (N, C, H, W) with zero `padding` and `dilation`, of
    shape (N, O, *dilated_size); `conv` convolves one phase (stride 1, no padding)."""
    b, ch, h, w = shape
    (kh, kw), (dh, dw) = kernel, dilation
    sizes = [h + 2 * padding[0], w + 2 * padding[1]]
    out = dilated_size(shape, kernel, padding, dilation)
    grown = [-(-sizes[0] // dh) * dh, -(-sizes[1] // dw) * dw]  # to a multiple of d
    hq, wq = grown[0] // dh, grown[1] // dw
    if hq < kh or wq < kw or min(out) < 1:
        raise UnsupportedOpError(
            c.describe(n, f"dilates a {kh}x{kw} kernel by {dilation} beyond its {h}x{w} input")
        )
    pads = [
        padding[1],
        padding[1] + grown[1] - sizes[1],
        padding[0],
        padding[0] + grown[0] - sizes[0],
    ]
    v = padded(c, n, x, shape, pads, "constant") if any(pads) else x
    split = (b, ch, hq, dh, wq, dw)
    v = reshaped(c, v, split)
    phase_shape = (b, ch, hq, wq)
    done = (b, out_channels, hq - kh + 1, wq - kw + 1)
    rows = []
    for u in range(dh):
        row = sliced(c, v, split, 3, u, u + 1)
        cols = []
        for t in range(dw):
            one = (b, ch, hq, 1, wq, dw)
            phase = sliced(c, row, one, 5, t, t + 1)
            cols.append(conv(reshaped(c, phase, phase_shape), done))
        rows.append(interleaved(c, cols, done, 3) if dw > 1 else cols[0])
    wide = (b, out_channels, done[2], done[3] * dw)
    y = interleaved(c, rows, wide, 2) if dh > 1 else rows[0]
    full = (b, out_channels, done[2] * dh, done[3] * dw)
    if full[2] != out[0]:
        y = sliced(c, y, full, 2, 0, out[0])
        full = (b, out_channels, out[0], full[3])
    if full[3] != out[1]:
        y = sliced(c, y, full, 3, 0, out[1])
    return y
