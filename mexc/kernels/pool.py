"""Max, average and global average pooling and nearest upsampling (N, C, H, W), forward and
backward."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mexc.kernels._common import (
    MAG,
    activation_qmax,
    compact_mx,
    debug_on,
    fast_compact_to_bits,
    global_abs_max,
    i64,
    scalar_exp,
    site_key,
)
from mexc.kernels.conv import IntPair, _pair
from mexc.mx import MX, RoundCtx
from mexc.numerics import (
    Reciprocal,
    ceil_log2,
    check_int32,
    div_const,
    shift_left,
)

DIV_BITS = 15  # div_const inputs are brought to |x| <= 2^15


def _windows(
    xm: np.ndarray,
    k: tuple[int, int],
    s: tuple[int, int],
    p: tuple[int, int],
    fill: int,
    extra: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """Every pooling window; `extra` pads the bottom and right once more (ceil_mode)."""
    pads = ((0, 0), (0, 0), (p[0], p[0] + extra[0]), (p[1], p[1] + extra[1]))
    xp = np.pad(xm, pads, constant_values=fill)
    return sliding_window_view(xp, k, axis=(2, 3))[:, :, :: s[0], :: s[1]]


def maxpool2d_forward(
    x: MX,
    kernel: IntPair,
    stride: IntPair | None = None,
    padding: IntPair = 0,
    extra: tuple[int, int] = (0, 0),
) -> tuple[MX, np.ndarray]:
    """y = window max (exponent unchanged; padding never wins). Returns (y, argmax) where argmax
    is the offset i*KW + j inside the window of the first maximum (row-major), int8/int64.
    `extra`: padding added at the bottom and right only (torch's ceil_mode windows)."""
    k = _pair(kernel)
    s = _pair(stride if stride is not None else kernel)
    if k == (2, 2) and s == (2, 2) and _pair(padding) == (0, 0) and tuple(extra) == (0, 0):
        fast = _maxpool2x2(x)
        if fast is not None:
            return fast
    win = _windows(np.asarray(x.m, np.int16), k, s, _pair(padding), -(1 << 14), _pair(extra))
    flat = win.reshape(win.shape[:4] + (k[0] * k[1],))
    arg = flat.argmax(axis=-1)
    y = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    return MX(y.astype(np.int8), x.e), arg


def _maxpool2x2(x: MX) -> tuple[MX, np.ndarray] | None:
    """Kernel 2, stride 2, no padding on int8 input: the four strided views compared directly.
    The first maximum wins ties (offsets 0 < 1 < 2 < 3), as argmax over the window does."""
    xm = np.asarray(x.m)
    if xm.dtype != np.int8 or xm.ndim != 4 or xm.shape[2] < 2 or xm.shape[3] < 2:
        return None
    oh, ow = xm.shape[2] // 2, xm.shape[3] // 2
    v = xm[:, :, : 2 * oh, : 2 * ow]
    a, b = v[:, :, 0::2, 0::2], v[:, :, 0::2, 1::2]
    c, d = v[:, :, 1::2, 0::2], v[:, :, 1::2, 1::2]
    top = np.maximum(a, b)
    bot = np.maximum(c, d)
    bit = np.greater(b, a).view(np.int8)  # new arrays: the int8 views are ours
    bit_bot = np.greater(d, c).view(np.int8)
    lower = np.greater(bot, top).view(np.int8)
    y = np.maximum(top, bot)
    bit_bot ^= bit
    bit_bot &= np.negative(lower)
    bit ^= bit_bot  # the winning pair's in-pair offset
    lower <<= np.int8(1)
    bit += lower
    return MX(y, x.e), bit.astype(np.intp)


def _maxpool2x2_backward(dy: MX, argmax: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray | None:
    """Scatter of int8 dy for kernel == stride == 2, no padding (no overlap: dy lands exactly)."""
    dm = np.asarray(dy.m)
    if dm.dtype != np.int8 or len(x_shape) != 4 or dm.ndim != 4:
        return None
    n, c, h, w = x_shape
    oh, ow = dm.shape[2], dm.shape[3]
    if dm.shape[:2] != (n, c) or oh != h // 2 or ow != w // 2 or argmax.shape != dm.shape:
        return None
    out = np.zeros((n, c, h, w), np.int8)
    arg = argmax.astype(np.int8)
    for i in range(2):
        for j in range(2):
            sel = np.equal(arg, 2 * i + j).view(np.int8)
            np.negative(sel, out=sel)
            np.bitwise_and(dm, sel, out=out[:, :, i : 2 * oh : 2, j : 2 * ow : 2])
    return out


def _scatter(
    vals: np.ndarray,
    sel: np.ndarray | None,
    x_shape: tuple[int, ...],
    k: tuple[int, int],
    s: tuple[int, int],
    p: tuple[int, int],
    extra: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """Sum vals (N, C, OH, OW) into every window position (where sel == offset, if given)."""
    n, c, h, w = x_shape
    oh, ow = vals.shape[2], vals.shape[3]
    out = np.zeros((n, c, h + 2 * p[0] + extra[0], w + 2 * p[1] + extra[1]), np.int64)
    for i in range(k[0]):
        for j in range(k[1]):
            v = vals if sel is None else np.where(sel == i * k[1] + j, vals, 0)
            out[:, :, i : i + s[0] * (oh - 1) + 1 : s[0], j : j + s[1] * (ow - 1) + 1 : s[1]] += v
    return out[:, :, p[0] : p[0] + h, p[1] : p[1] + w]


def maxpool2d_backward(
    dy: MX,
    argmax: np.ndarray,
    x_shape: tuple[int, ...],
    kernel: IntPair,
    stride: IntPair | None,
    padding: IntPair,
    ctx: RoundCtx,
    tid: int,
    extra: tuple[int, int] = (0, 0),
) -> MX:
    """dx = scatter-add of dy at the argmax positions (integer add: one exponent). Without
    overlap the result is dy's mantissas exactly; else compaction if it exceeds qmax (site 0)."""
    k = _pair(kernel)
    s = _pair(stride if stride is not None else kernel)
    plain = _pair(padding) == (0, 0) and tuple(extra) == (0, 0)
    rows = ctx.rows  # data parallel: the fit is decided over every worker's rows
    if k == (2, 2) and s == (2, 2) and plain and not debug_on():
        fast = _maxpool2x2_backward(dy, np.asarray(argmax), tuple(x_shape))
        if fast is not None and global_abs_max(fast, rows) <= activation_qmax(ctx):
            return MX(fast, dy.e)
    acc = _scatter(i64(dy.m), argmax, tuple(x_shape), k, s, _pair(padding), _pair(extra))
    check_int32(acc, "maxpool2d_backward")
    if acc.size and global_abs_max(acc, rows) <= activation_qmax(ctx):
        return MX(acc.astype(np.int8), dy.e)
    return compact_mx(acc, dy.e, ctx, site_key(ctx, tid, 0), batch=True)


def _divide(acc: np.ndarray, e: int, bound_bits: int, count: int, ctx: RoundCtx, tid: int) -> MX:
    """acc * 2^e / count -> MX. |acc| < 2^bound_bits (static). If bound_bits <= 15 the sum is
    shifted left exactly by 15 - bound_bits, else compacted to |.| <= 2^15 (site 0);
    div_const by count (exact nearest on the odd part, pow2 into the exponent); compaction
    (site 1)."""
    if bound_bits <= DIV_BITS:
        sl = DIV_BITS - bound_bits
        a, ea = shift_left(acc, sl, "pool_divide"), np.asarray(e - sl, np.int64)
    else:
        key = site_key(ctx, tid, 0)
        a, ea = fast_compact_to_bits(acc, e, DIV_BITS, ctx.rounding, key, ctx.rows)
    q, eq = div_const(a, ea, Reciprocal.of(count))
    return compact_mx(q, eq, ctx, site_key(ctx, tid, 1), batch=True)


def avgpool2d_forward(
    x: MX, kernel: IntPair, stride: IntPair | None, padding: IntPair, ctx: RoundCtx, tid: int
) -> MX:
    """y = window sum / (KH*KW) (zero padding counted, torch count_include_pad=True).
    Sum of KH*KW mantissas (bound 2^(7 + ceil log2 KH*KW)), then _divide (sites 0, 1)."""
    e = scalar_exp(x, "avgpool input")
    k = _pair(kernel)
    s = _pair(stride if stride is not None else kernel)
    win = _windows(i64(x.m), k, s, _pair(padding), 0)
    acc = win.sum(axis=(-2, -1))
    check_int32(acc, "avgpool2d_forward")
    kk = k[0] * k[1]
    return _divide(acc, e, MAG + ceil_log2(kk), kk, ctx, tid)


def avgpool2d_backward(
    dy: MX,
    x_shape: tuple[int, ...],
    kernel: IntPair,
    stride: IntPair | None,
    padding: IntPair,
    ctx: RoundCtx,
    tid: int,
) -> MX:
    """g = dy / (KH*KW) (dy << 8, div_const, exponent e - 8 - pow2: exact, no site), then
    scatter-add of g into every window position and compaction (site 0)."""
    e = scalar_exp(dy, "dy")
    k = _pair(kernel)
    s = _pair(stride if stride is not None else kernel)
    kk = k[0] * k[1]
    g, eg = div_const(i64(dy.m) << (DIV_BITS - MAG), e - (DIV_BITS - MAG), Reciprocal.of(kk))
    acc = _scatter(g, None, tuple(x_shape), k, s, _pair(padding))
    check_int32(acc, "avgpool2d_backward")
    return compact_mx(acc, eg, ctx, site_key(ctx, tid, 0), batch=True)


def global_avgpool_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    """AdaptiveAvgPool2d(1): (N, C, H, W) -> (N, C, 1, 1), sum / (H*W) via _divide (sites 0, 1)."""
    e = scalar_exp(x, "global avgpool input")
    n, c, h, w = x.shape
    acc = i64(x.m).sum(axis=(2, 3), keepdims=True)
    check_int32(acc, "global_avgpool_forward")
    return _divide(acc, e, MAG + ceil_log2(h * w), h * w, ctx, tid)


def global_avgpool_backward(dy: MX, x_shape: tuple[int, ...], ctx: RoundCtx, tid: int) -> MX:
    """dx = broadcast(dy / (H*W)): dy << 8, div_const, compaction (site 0)."""
    e = scalar_exp(dy, "dy")
    _, c, h, w = x_shape
    n = dy.shape[0]  # this worker's rows in a data-parallel step
    g, eg = div_const(
        i64(dy.m).reshape(n, c, 1, 1) << (DIV_BITS - MAG),
        e - (DIV_BITS - MAG),
        Reciprocal.of(h * w),
    )
    full = np.broadcast_to(g, (n, c, h, w))
    return compact_mx(full, eg, ctx, site_key(ctx, tid, 0), batch=True)


# ----------------------------------------------------------------------------- upsampling


def upsample_nearest_forward(x: MX, scale: IntPair) -> MX:
    """Nearest upsampling by integer factors (sh, sw): y[n, c, i, j] = x[n, c, i // sh, j // sw],
    the exponent kept (no rounding)."""
    sh, sw = _pair(scale)
    return MX(np.repeat(np.repeat(x.m, sh, axis=2), sw, axis=3), x.e)


def upsample_nearest_backward(dy: MX, scale: IntPair, ctx: RoundCtx, tid: int) -> MX:
    """dx[n, c, i, j] = the sum of dy over the (sh, sw) block that copied x[n, c, i, j] (int
    add: one exponent, |acc| <= 128 sh sw); compaction (site 0), shift 0 where it fits."""
    sh, sw = _pair(scale)
    n, c, h, w = dy.m.shape
    acc = i64(dy.m).reshape(n, c, h // sh, sh, w // sw, sw).sum(axis=(3, 5))
    check_int32(acc, "upsample_nearest_backward")
    return compact_mx(acc, dy.e, ctx, site_key(ctx, tid, 0), batch=True)
