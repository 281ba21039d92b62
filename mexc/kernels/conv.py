"""2-D convolution (groups, incl. depthwise) by im2col + int_matmul (== numerics.matmul_exact), and
gradients.

Layouts: x (N, C, H, W), w (O, C/G, KH, KW), y (N, O, OH, OW). Dilation 1. Zero padding.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mexc.kernels._common import (
    F32_EXACT,
    F64_EXACT,
    INT8_CONTAINER,
    compact_mx,
    debug_on,
    fit_product,
    global_rows,
    i64,
    int_matmul,
    row_offset,
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


W8 = INT8_CONTAINER**2  # bound of one int8 x int8 product (|v| <= 128, -128 included)


def _cols_t(xm: np.ndarray, kh: int, kw: int, ph: int, pw: int, dtype: type) -> np.ndarray:
    """Stride-1 im2col, channel-major: (N, C, H, W) -> (C*KH*KW, N*OH*OW), rows ordered
    (c, kh, kw) like the weight, columns (n, oh, ow). Built window by window into one buffer so
    one large GEMM does the whole layer."""
    n, c, h, w = xm.shape
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    xp = np.zeros((c, n, h + 2 * ph, w + 2 * pw), dtype)
    xp[:, :, ph : ph + h, pw : pw + w] = np.asarray(xm).transpose(1, 0, 2, 3)
    cols = np.empty((c, kh, kw, n, oh, ow), dtype)
    for i in range(kh):
        for j in range(kw):
            cols[:, i, j] = xp[:, :, i : i + oh, j : j + ow]
    return cols.reshape(c * kh * kw, n * oh * ow)


def _conv_s1_f32(xm: np.ndarray, wm: np.ndarray, ph: int, pw: int) -> np.ndarray | None:
    """Exact stride-1, groups-1 convolution (N, O, OH, OW) as int32 via float32 BLAS: exact (as
    int_matmul's float paths are) when every partial sum, a sum of at most K = C*KH*KW products
    of int8 values (|x|, |w| <= 128), is below 2^24: 128^2 * K < 2^24, K <= 1023. None when the
    bound does not hold (and in overflow_debug mode): the caller takes the int_matmul path."""
    o, c, kh, kw = wm.shape
    k = c * kh * kw
    if W8 * k >= F32_EXACT or debug_on():
        return None
    n, _, h, w = xm.shape
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    if oh < 1 or ow < 1:
        return None
    cols = _cols_t(xm, kh, kw, ph, pw, np.float32)
    acc = np.asarray(wm, np.float32).reshape(o, k) @ cols  # (O, N*OH*OW)
    acc = acc.reshape(o, n, oh, ow).transpose(1, 0, 2, 3)
    return acc.astype(np.int32, order="C")


def _exact_chunk(total: int) -> int:
    """Largest divisor L of `total` with 128^2 * L < 2^24 (float32-exact L-wide sums)."""
    for cand in range(min(total, (F32_EXACT - 1) // W8), 0, -1):
        if total % cand == 0:
            return cand
    return 1


def _grad_weight_gemm(
    xm: np.ndarray, dm: np.ndarray, kh: int, kw: int, ph: int, pw: int
) -> np.ndarray:
    """dW (O, C*KH*KW) int64 = sum over (n, oh, ow) of dy * cols, exactly, for int8 operands
    (|v| <= 128): the reduction of width T = N*OH*OW is cut into chunks of L columns whose
    float32 sums are exact (128^2 * L < 2^24), one batched GEMM over the chunks, then a float64
    sum of the chunk results; without a chunk of 64 or more, one float64 GEMM. Every float64
    partial sum is a sum of at most T products, exact when 128^2 * T < 2^53 (T < 2^39): checked
    here, raising when it does not hold (the caller guards it and takes int_matmul instead)."""
    n, o = dm.shape[0], dm.shape[1]
    total = n * dm.shape[2] * dm.shape[3]
    if W8 * total >= F64_EXACT:
        raise ValueError(f"reduction of {total} products is beyond float64's exact range")
    chunk = _exact_chunk(total)
    if chunk >= 64:
        cols = _cols_t(xm, kh, kw, ph, pw, np.float32)  # (K, N*P)
        k = cols.shape[0]
        # dy as (N*P, O) rows: both batched operands are row-major (BLAS-able) chunk views
        dt = np.asarray(dm).reshape(n, o, -1).transpose(0, 2, 1).astype(np.float32, order="C")
        nb = total // chunk
        part = np.matmul(
            cols.reshape(k, nb, chunk).transpose(1, 0, 2), dt.reshape(nb, chunk, o)
        )  # (nb, K, O), every entry exact
        part = part.sum(axis=0, dtype=np.float64).T  # (O, K)
        return part.astype(np.int64, order="C")
    cols64 = _cols_t(xm, kh, kw, ph, pw, np.float64)  # float64: partial sums < 2^53, exact
    d64 = np.asarray(dm).transpose(1, 0, 2, 3).astype(np.float64, order="C").reshape(o, -1)
    return (cols64 @ d64.T).T.astype(np.int64, order="C")


def _check(x_shape: tuple[int, ...], w_shape: tuple[int, ...], groups: int) -> None:
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError("conv2d needs 4-D input and weight")
    if x_shape[1] != w_shape[1] * groups or w_shape[0] % groups:
        raise ValueError(f"conv2d shapes {x_shape} / {w_shape} do not match groups={groups}")


def conv2d_accumulate(
    x: MX,
    w: MX,
    bias: MX | None,
    stride: IntPair,
    padding: IntPair,
    groups: int,
    ctx: RoundCtx,
    tid: int,
) -> Acc:
    """conv2d_forward before its output compaction: one int32 accumulator per output
    (exponent e_x + e_w; bias aligned by sites 1/2; site 3 pre-shift of x if
    product_cap(K, 8) < 0)."""
    _check(x.shape, w.shape, groups)
    ex, ew = scalar_exp(x, "conv input"), scalar_exp(w, "conv weight")
    o, cg, kh, kw = w.shape
    k = cg * kh * kw
    xm, ex = fit_product(x.m, ex, k, ctx, site_key(ctx, tid, 3), row_offset(x.m, ctx.rows))
    if bias is None and groups == 1 and _pair(stride) == (1, 1):
        fast = _conv_s1_f32(xm, w.m, *_pair(padding))
        if fast is not None:
            return Acc(fast, np.asarray(ex + ew, np.int64))
    cols, oh, ow = _im2col(xm, kh, kw, _pair(stride), _pair(padding), groups)
    og = o // groups
    wg = i64(w.m).reshape(groups, og, k).transpose(0, 2, 1)
    acc = int_matmul(cols, wg)  # (G, N*OH*OW, Og)
    n = x.shape[0]
    acc = acc.reshape(groups, n, oh, ow, og).transpose(1, 0, 4, 2, 3).reshape(n, o, oh, ow)
    acc, e = add_bias(acc, ex + ew, k, bias, 1, ctx, tid)
    return Acc(acc, e)


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
    acc = conv2d_accumulate(x, w, bias, stride, padding, groups, ctx, tid)
    return compact_mx(acc.a, acc.e, ctx, site_key(ctx, tid, 0), batch=True)


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
    start = row_offset(dy.m, ctx.rows)
    dm, ed = fit_product(dy.m, ed, og * kh * kw, ctx, site_key(ctx, tid, 3), start)
    _, _, oh, ow = dy.shape
    if (
        groups == 1
        and (sh, sw) == (1, 1)
        and oh == h + 2 * ph - kh + 1
        and ow == wd + 2 * pw - kw + 1
    ):
        # dx[n,c,y,x] = sum_{o,i,j} dy[n,o,y+ph-i,x+pw-j] w[o,c,i,j]: the same exact sums
        wt = np.ascontiguousarray(np.asarray(w.m)[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        fast = _conv_s1_f32(dm, wt, kh - 1 - ph, kw - 1 - pw)
        if fast is not None and kh - 1 - ph >= 0 and kw - 1 - pw >= 0:
            return compact_mx(fast, ed + ew, ctx, site_key(ctx, tid, 0), batch=True)
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
    return compact_mx(dx, ed + ew, ctx, site_key(ctx, tid, 0), batch=True)


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
    With ctx.rows, N counts every data-parallel worker's rows and the result is this
    worker's share of the sum (an ALL_REDUCE node adds the shares).
    """
    _check(x.shape, tuple(w_shape), groups)
    ed, ex = scalar_exp(dy, "dy"), scalar_exp(x, "x")
    o, cg, kh, kw = w_shape
    og = o // groups
    n, _, oh, ow = dy.shape
    key = site_key(ctx, tid, 3) if ctx is not None else 0
    rows = ctx.rows if ctx is not None else None
    width = global_rows(n, rows) * oh * ow
    dm, ed = fit_product(dy.m, ed, width, ctx, key, row_offset(dy.m, rows))
    ph, pw = _pair(padding)
    if (
        groups == 1
        and _pair(stride) == (1, 1)
        and not debug_on()
        and W8 * n * oh * ow < F64_EXACT
        and (oh, ow) == (x.shape[2] + 2 * ph - kh + 1, x.shape[3] + 2 * pw - kw + 1)
    ):
        acc = _grad_weight_gemm(x.m, dm, kh, kw, ph, pw)
        return Acc(acc.reshape(o, cg, kh, kw), np.asarray(ed + ex, np.int64))
    cols, oh2, ow2 = _im2col(x.m, kh, kw, _pair(stride), _pair(padding), groups)
    if (oh2, ow2) != (oh, ow):
        raise ValueError("dy spatial size does not match the convolution")
    d = dm.reshape(n, groups, og, oh, ow).transpose(1, 2, 0, 3, 4).reshape(groups, og, -1)
    acc = int_matmul(d, cols)  # (G, Og, K)
    return Acc(acc.reshape(o, cg, kh, kw), np.asarray(ed + ex, np.int64))
