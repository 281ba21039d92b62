"""2-D convolution (groups, incl. depthwise) by im2col + numerics.matmul_exact, and gradients.

Layouts: x (N, C, H, W), w (O, C/G, KH, KW), y (N, O, OH, OW). Dilation 1. Zero padding.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mexc.kernels._common import (
    compact_mx,
    debug_on,
    fit_product,
    i64,
    int_matmul,
    scalar_exp,
    site_key,
)
from mexc.kernels.linear import add_bias
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import check_int32

IntPair = int | tuple[int, int]


def _pair(v: IntPair) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _out_size(h: int, k: int, s: int, p: int) -> int:
    return (h + 2 * p - k) // s + 1


def _im2col(
    xm: np.ndarray, kh: int, kw: int, stride: tuple[int, int], padding: tuple[int, int], groups: int
) -> tuple[np.ndarray, int, int]:
    """(N, C, H, W) -> cols (G, N*OH*OW, C/G*KH*KW), column order (c, kh, kw) like the weight."""
    n, c, _, _ = xm.shape
    ph, pw = padding
    xp = np.pad(xm, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    win = sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, :: stride[0], :: stride[1]]
    oh, ow = win.shape[2], win.shape[3]
    cg = c // groups
    cols = win.reshape(n, groups, cg, oh, ow, kh, kw).transpose(1, 0, 3, 4, 2, 5, 6)
    return cols.reshape(groups, n * oh * ow, cg * kh * kw), oh, ow


F32_EXACT = 2**24  # float32 partial sums are exact integers below this


def _cols_f32(xm: np.ndarray, kh: int, kw: int, ph: int, pw: int) -> np.ndarray:
    """Stride-1 im2col in float32: (N, C, H, W) -> (N, C*KH*KW, OH*OW), rows ordered (c, kh, kw)
    like the weight. Built window by window into one buffer (no padded int64 copy)."""
    n, c, h, w = xm.shape
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    xp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), np.float32)
    xp[:, :, ph : ph + h, pw : pw + w] = xm
    cols = np.empty((n, c, kh, kw, oh, ow), np.float32)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i, j] = xp[:, :, i : i + oh, j : j + ow]
    return cols.reshape(n, c * kh * kw, oh * ow)


def _conv_s1_f32(xm: np.ndarray, wm: np.ndarray, ph: int, pw: int) -> np.ndarray | None:
    """Exact stride-1, groups-1 convolution (N, O, OH, OW) as int32 via float32 BLAS, when every
    partial sum is an integer below 2^24 (|x|, |w| <= 128). None if the bound does not hold."""
    o, c, kh, kw = wm.shape
    k = c * kh * kw
    if 128 * 128 * k >= F32_EXACT or debug_on():
        return None
    n, _, h, w = xm.shape
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    if oh < 1 or ow < 1:
        return None
    cols = _cols_f32(xm, kh, kw, ph, pw)
    acc = np.matmul(np.asarray(wm, np.float32).reshape(o, k), cols)  # (N, O, OH*OW)
    return acc.astype(np.int32).reshape(n, o, oh, ow)


def _check(x_shape: tuple[int, ...], w_shape: tuple[int, ...], groups: int) -> None:
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError("conv2d needs 4-D input and weight")
    if x_shape[1] != w_shape[1] * groups or w_shape[0] % groups:
        raise ValueError(f"conv2d shapes {x_shape} / {w_shape} do not match groups={groups}")


def conv2d_forward(
    x: MX,
    w: MX,
    bias: MX | None,
    stride: IntPair,
    padding: IntPair,
    groups: int,
    ctx: RoundCtx,
    tid: int,
) -> MX:
    """y = conv(x, w) (+ b) with one int32 accumulator per output (exponent e_x + e_w).

    K = C/G*KH*KW. Sites: 0 output compaction, 1/2 bias alignment (acc, bias),
    3 pre-shift of x if product_cap(K, 8) < 0.
    """
    _check(x.shape, w.shape, groups)
    ex, ew = scalar_exp(x, "conv input"), scalar_exp(w, "conv weight")
    o, cg, kh, kw = w.shape
    k = cg * kh * kw
    xm, ex = fit_product(x.m, ex, k, ctx, site_key(ctx, tid, 3))
    if bias is None and groups == 1 and _pair(stride) == (1, 1):
        fast = _conv_s1_f32(xm, w.m, *_pair(padding))
        if fast is not None:
            return compact_mx(fast, ex + ew, ctx, site_key(ctx, tid, 0))
    cols, oh, ow = _im2col(xm, kh, kw, _pair(stride), _pair(padding), groups)
    og = o // groups
    wg = i64(w.m).reshape(groups, og, k).transpose(0, 2, 1)
    acc = int_matmul(cols, wg)  # (G, N*OH*OW, Og)
    n = x.shape[0]
    acc = acc.reshape(groups, n, oh, ow, og).transpose(1, 0, 4, 2, 3).reshape(n, o, oh, ow)
    acc, e = add_bias(acc, ex + ew, k, bias, 1, ctx, tid)
    return compact_mx(acc, e, ctx, site_key(ctx, tid, 0))


def conv2d_backward_input(
    dy: MX,
    w: MX,
    x_shape: tuple[int, ...],
    stride: IntPair,
    padding: IntPair,
    groups: int,
    ctx: RoundCtx,
    tid: int,
) -> MX:
    """dx = conv_transpose(dy, w): dcols = dy @ w per group, then col2im (a loop over KH*KW).

    Every dx element is an exact sum of at most O/G*KH*KW int8 products (exponent e_dy + e_w).
    Sites: 0 compaction, 3 pre-shift of dy if product_cap(O/G*KH*KW, 8) < 0.
    """
    _check(tuple(x_shape), w.shape, groups)
    ed, ew = scalar_exp(dy, "dy"), scalar_exp(w, "conv weight")
    n, c, h, wd = x_shape
    o, cg, kh, kw = w.shape
    og = o // groups
    sh, sw = _pair(stride)
    ph, pw = _pair(padding)
    dm, ed = fit_product(dy.m, ed, og * kh * kw, ctx, site_key(ctx, tid, 3))
    _, _, oh, ow = dy.shape
    if groups == 1 and (sh, sw) == (1, 1) and oh == h + 2 * ph - kh + 1 and ow == wd + 2 * pw - kw + 1:
        # dx[n,c,y,x] = sum_{o,i,j} dy[n,o,y+ph-i,x+pw-j] w[o,c,i,j]: the same exact sums
        wt = np.ascontiguousarray(np.asarray(w.m)[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        fast = _conv_s1_f32(dm, wt, kh - 1 - ph, kw - 1 - pw)
        if fast is not None and kh - 1 - ph >= 0 and kw - 1 - pw >= 0:
            return compact_mx(fast, ed + ew, ctx, site_key(ctx, tid, 0))
    d = dm.reshape(n, groups, og, oh, ow).transpose(1, 0, 3, 4, 2).reshape(groups, -1, og)
    wg = i64(w.m).reshape(groups, og, cg * kh * kw)
    dcols = int_matmul(d, wg)  # (G, N*OH*OW, Cg*KH*KW)
    dcols = dcols.reshape(groups, n, oh, ow, cg, kh, kw).transpose(1, 0, 4, 5, 6, 2, 3)
    dcols = dcols.reshape(n, c, kh, kw, oh, ow)
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), np.int64)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw] += dcols[
                :, :, i, j
            ]
    dx = dxp[:, :, ph : ph + h, pw : pw + wd]
    check_int32(dx, "conv2d_backward_input")
    return compact_mx(dx, ed + ew, ctx, site_key(ctx, tid, 0))


def conv2d_backward_weight(
    dy: MX,
    x: MX,
    w_shape: tuple[int, ...],
    stride: IntPair,
    padding: IntPair,
    groups: int,
    ctx: RoundCtx | None = None,
    tid: int = 0,
) -> Acc:
    """dW[o, c, i, j] = sum_{n, oh, ow} dy[n, o, oh, ow] * xpad[n, c, oh*s + i, ow*s + j].

    Un-compacted int32 accumulator, exponent e_dy + e_x. Reduction width N*OH*OW; if
    product_cap(N*OH*OW, 8) < 0 dy is pre-shifted (site 3 of ctx/tid; nearest without ctx).
    """
    _check(x.shape, tuple(w_shape), groups)
    ed, ex = scalar_exp(dy, "dy"), scalar_exp(x, "x")
    o, cg, kh, kw = w_shape
    og = o // groups
    n, _, oh, ow = dy.shape
    key = site_key(ctx, tid, 3) if ctx is not None else 0
    dm, ed = fit_product(dy.m, ed, n * oh * ow, ctx, key)
    ph, pw = _pair(padding)
    if (
        groups == 1
        and _pair(stride) == (1, 1)
        and not debug_on()
        and 128 * 128 * oh * ow < F32_EXACT
        and (oh, ow) == (x.shape[2] + 2 * ph - kh + 1, x.shape[3] + 2 * pw - kw + 1)
    ):
        # per image: dy[n] (O, P) @ cols[n]^T (P, K), exact in float32 (P-wide sums < 2^24);
        # the sum over images is exact in float64 (|total| < 2^31 by the caps)
        cols = _cols_f32(x.m, kh, kw, ph, pw)  # (N, K, P)
        d32 = np.asarray(dm, np.float32).reshape(n, o, oh * ow)
        part = np.matmul(d32, cols.transpose(0, 2, 1))  # (N, O, K)
        acc = part.sum(axis=0, dtype=np.float64).astype(np.int64)
        return Acc(acc.reshape(o, cg, kh, kw), np.asarray(ed + ex, np.int64))
    cols, oh2, ow2 = _im2col(x.m, kh, kw, _pair(stride), _pair(padding), groups)
    if (oh2, ow2) != (oh, ow):
        raise ValueError("dy spatial size does not match the convolution")
    d = dm.reshape(n, groups, og, oh, ow).transpose(1, 2, 0, 3, 4).reshape(groups, og, -1)
    acc = int_matmul(d, cols)  # (G, Og, K)
    return Acc(acc.reshape(o, cg, kh, kw), np.asarray(ed + ex, np.int64))
