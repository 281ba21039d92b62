"""nn.Conv3d as 2-D convolutions over the frames (torchvision's video ResNets, LambdaNet's
position lambdas).

For x (N, C, T, H, W) and a weight (O, C, kt, kh, kw), frame t' of the result is the sum over
the kt taps k of the 2-D convolution of input frame t' st + k with the weight's slice k. The
frames are merged into the batch, (N T, C, H, W), and one conv2d computes every tap at once:
its weight is the parameter held rearranged as (kt O, C, kh, kw) (tap-major), so output channel
k O + o of frame t is tap k's contribution of frame t. Each tap's channels are then sliced at
the frames that feed it (every st-th from k) and the kt slices added. The temporal padding is
zero frames around the input; the bias is added once, after the sum. Same arithmetic as the
3-D convolution's, in the int8 format of its parts: each tap's partial result is compacted to
int8 before the sum (kt roundings instead of one), and at a temporal stride st the conv2d
computes st times the frames it keeps. No new op: every kernel is conv2d's, slice's and add's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mexc.arrangement import Arrangement
from mexc.errors import UnsupportedOpError
from mexc.ir import Op, Value
from mexc.ops.common import static_int
from mexc.ops.tensor import added, every_nth, padded, reshaped, sliced, transposed

# conv2d(x, weight, input shape (N, C, H, W), kernel, stride, padding, result shape):
# dense's CONV2D
Conv2d = Callable[
    [
        Value,
        Value,
        tuple[int, ...],
        tuple[int, int],
        tuple[int, int],
        tuple[int, int],
        tuple[int, ...],
    ],
    Value,
]


def _triple(c: Any, n: Any, v: Any, what: str) -> tuple[int, int, int]:
    if isinstance(v, str):
        raise UnsupportedOpError(c.describe(n, f"has {what} {v!r}; give numbers"))
    t = tuple(static_int(a) for a in (v if isinstance(v, (list, tuple)) else (v, v, v)))
    return (t[0], t[1], t[2])


def conv3d_module(c: Any, n: Any, m: Any, conv2d: Conv2d) -> Value:
    """nn.Conv3d over (N, C, T, H, W)."""
    if m.padding_mode != "zeros":
        raise UnsupportedOpError(c.describe(n, f"pads with mode {m.padding_mode!r}; give zeros"))
    bias = c.param(f"{n.target}.bias", m.bias, "bias") if m.bias is not None else None
    geometry = (m.stride, m.padding, m.dilation, m.groups)
    return _conv3d(c, n, n.args[0], (str(n.target) + ".weight", m.weight), bias, geometry, conv2d)


def conv3d_function(c: Any, n: Any, conv2d: Conv2d) -> Value:
    """F.conv3d(x, weight, bias, stride, padding, dilation, groups) of module parameters
    (torchvision's Conv3DSimple, an nn.Conv3d subclass, traced through)."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    w, b = args["weight"], args.get("bias")
    if not c.is_param(w):
        raise UnsupportedOpError(c.describe(n, "needs its weight to be a module parameter"))
    bias = c.get_param(b, "bias") if b is not None else None
    geometry = tuple(args.get(k, d) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1)))
    weight = (str(w.target), c.fetch(w))
    return _conv3d(c, n, args["input"], weight, bias, (*geometry, args.get("groups", 1)), conv2d)


def _conv3d(
    c: Any,
    n: Any,
    x: Any,
    weight: tuple[str, Any],
    bias: Value | None,
    geometry: tuple[Any, Any, Any, Any],
    conv2d: Conv2d,
) -> Value:
    """The 3-D convolution of x by the parameter `weight` (its name, its torch tensor
    (O, C, kt, kh, kw)): groups 1, no dilation, zero padding; `geometry` (stride, padding,
    dilation, groups) as torch takes them."""
    shape = tuple(c.shape(x))
    if len(shape) != 5:
        raise UnsupportedOpError(
            c.describe(n, "convolves an unbatched input; give (N, C, T, H, W)")
        )
    stride, padding, dilation, groups = geometry
    if static_int(groups) != 1 or _triple(c, n, dilation, "dilation") != (1, 1, 1):
        raise UnsupportedOpError(
            c.describe(
                n, "is a grouped or dilated 3-D convolution; mexc takes groups=1, dilation=1"
            )
        )
    name, tensor = weight
    o, _, kt, kh, kw = (int(d) for d in tensor.shape)
    st, sh, sw = _triple(c, n, stride, "stride")
    pt, ph, pw = (0, 0, 0) if padding == "valid" else _triple(c, n, padding, "padding")
    b, ch, t, h, w = shape
    v = c.arg(x)
    if pt:
        v = padded(c, n, v, shape, [0, 0, 0, 0, pt, pt], "constant")
    frames = t + 2 * pt
    v = transposed(c, v, (b, ch, frames, h, w), (0, 2, 1, 3, 4))
    v = reshaped(c, v, (b * frames, ch, h, w))
    taps = tensor.permute(2, 0, 1, 3, 4).reshape(kt * o, ch, kh, kw)
    declared = tuple(int(d) for d in tensor.shape)
    arranged = Arrangement(declared, declared, (2, 0, 1, 3, 4))
    held = c.param(name, taps, "weight", "as kt * out conv2d kernels", n, arranged, tie=tensor)
    out_h, out_w = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    z = conv2d(
        v,
        held,
        (b * frames, ch, h, w),
        (kh, kw),
        (sh, sw),
        (ph, pw),
        (b * frames, kt * o, out_h, out_w),
    )
    every = (b, frames, kt, o, out_h, out_w)
    z = reshaped(c, z, every)
    out_t = (frames - kt) // st + 1
    total: Value | None = None
    for k in range(kt):
        tap = sliced(c, z, every, 2, k, k + 1)
        span = (out_t - 1) * st + 1
        part: tuple[int, ...] = (b, frames, 1, o, out_h, out_w)
        if (k, span) != (0, frames):
            tap = sliced(c, tap, part, 1, k, k + span)
            part = (b, span, 1, o, out_h, out_w)
        if st > 1:
            tap, part = every_nth(c, tap, part, 1, st)
        total = tap if total is None else added(c, total, tap, part)
    assert total is not None  # kt >= 1
    y = reshaped(c, total, (b, out_t, o, out_h, out_w))
    y = transposed(c, y, (b, out_t, o, out_h, out_w), (0, 2, 1, 3, 4))
    if bias is None:
        return y
    return c.emit(Op.ADD_PARAM, [y, bias], n, view=(1, o, 1, 1, 1))
