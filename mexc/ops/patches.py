"""nn.Unfold / F.unfold (im2col) and nn.Fold / F.fold (col2im) as convolutions with a constant
one-hot kernel.

Unfold's output channel c k_h k_w + i k_w + j holds input channel c at kernel tap (i, j) of
every window: the depthwise convolution (groups C) whose kernel for that channel is 1 at (i, j)
and 0 elsewhere. 1 is an int8 mantissa 64 at exponent -6, so each product is an input mantissa
times 64 and the compaction shifts it back: the patches are the input's mantissas, exactly.
Fold sums the patches back onto the image: the transposed convolution with the same kernel
(CONV2D_GRAD_INPUT in the forward graph, as ops.conv_transpose), whose sums of overlapping
patches are compacted once. The kernel is a frontend constant, never trained; the gradients
are the convolutions' (unfold's dx is fold of dy, fold's is unfold of dy). No new kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mexc.errors import UnsupportedOpError
from mexc.ir import Op, Value
from mexc.ops.common import pair, static_value
from mexc.ops.tensor import as_result, reshaped

_ARGS = ("input", "kernel_size", "dilation", "padding", "stride")
_FOLD_ARGS = ("input", "output_size", "kernel_size", "dilation", "padding", "stride")


def _geometry(c: Any, n: Any, m: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """kernel, padding, stride of nn.Unfold / nn.Fold (m) or their functions; dilation 1."""
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    get = (lambda k, d: getattr(m, k)) if m is not None else (lambda k, d: args.get(k, d))
    dilation = pair(static_value(get("dilation", 1)))
    if dilation != (1, 1):
        raise UnsupportedOpError(c.describe(n, f"takes patches with dilation {list(dilation)}"))
    return {
        "kernel": pair(static_value(get("kernel_size", None))),
        "padding": pair(static_value(get("padding", 0))),
        "stride": pair(static_value(get("stride", 1))),
        "output_size": static_value(get("output_size", None)) if "output_size" in names else None,
        "input": n.args[0] if n.args else args["input"],
    }


def _one_hot(c: Any, n: Any, channels: int, kernel: tuple[int, int]) -> Value:
    """The constant kernel (C kh kw, 1, kh, kw): output channel c kh kw + i kw + j is 1 at
    (i, j)."""
    kh, kw = kernel
    taps = kh * kw
    w = np.zeros((channels * taps, 1, kh, kw), np.float32)
    for t in range(taps):
        w[t::taps, 0, t // kw, t % kw] = 1.0
    return c.constant(f"{n.name}.patches", w, "weight")


def _image(c: Any, n: Any, x: Any, what: str) -> tuple[Value, tuple[int, ...]]:
    shape = tuple(c.shape(x))
    v = c.arg(x)
    if c.batch_axis(v) not in (0, None):
        raise UnsupportedOpError(c.describe(n, f"{what} whose batch is not axis 0"))
    return v, shape


def unfold(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Unfold, F.unfold of (N, C, H, W): (N, C kh kw, L) (VOLO's outlook attention, TNT)."""
    g = _geometry(c, n, m, _ARGS)
    v, shape = _image(c, n, g["input"], "takes patches of a tensor")
    if len(shape) != 4:
        raise UnsupportedOpError(c.describe(n, f"takes patches of a {len(shape)}-D tensor"))
    (kh, kw), (ph, pw), (sh, sw) = g["kernel"], g["padding"], g["stride"]
    oh, ow = (shape[2] + 2 * ph - kh) // sh + 1, (shape[3] + 2 * pw - kw) // sw + 1
    out = (shape[0], shape[1] * kh * kw, oh, ow)
    weight = _one_hot(c, n, shape[1], (kh, kw))
    conv = {"stride": (sh, sw), "padding": (ph, pw), "groups": shape[1], "has_bias": False}
    return as_result(c, n, c.emit_as(Op.CONV2D, [v, weight], out, **conv))


def fold(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Fold, F.fold of (N, C kh kw, L) into (N, C, H, W): the patches summed back."""
    g = _geometry(c, n, m, _FOLD_ARGS)
    v, shape = _image(c, n, g["input"], "folds patches")
    out = tuple(c.shape(n))
    (kh, kw), (ph, pw), (sh, sw) = g["kernel"], g["padding"], g["stride"]
    if len(shape) != 3 or len(out) != 4:
        raise UnsupportedOpError(c.describe(n, "folds patches other than (N, C kh kw, L)"))
    oh, ow = (out[2] + 2 * ph - kh) // sh + 1, (out[3] + 2 * pw - kw) // sw + 1
    rows = (shape[0], shape[1], oh, ow)
    conv = {"stride": (sh, sw), "padding": (ph, pw), "groups": out[1]}
    weight = _one_hot(c, n, out[1], (kh, kw))
    return c.emit(Op.CONV2D_GRAD_INPUT, [reshaped(c, v, rows), weight], n, **conv)
