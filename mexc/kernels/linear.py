"""Linear (fully connected) layer: y = x @ w^T + b, and its gradients."""

from __future__ import annotations

import numpy as np

from mexc.kernels._common import (
    MAG,
    aligned_sum_fast,
    compact_mx,
    fit_product,
    global_rows,
    i64,
    int_matmul,
    product_bits,
    row_offset,
    scalar_exp,
    site_key,
)
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import check_int32


def add_bias(
    acc: np.ndarray, e_acc: int, k: int, bias: MX | None, axis: int, ctx: RoundCtx, tid: int
) -> tuple[np.ndarray, np.ndarray]:
    """acc + bias (broadcast along `axis`) by numerics.aligned_sum; sites 1 (acc, batch-major),
    2 (bias)."""
    if bias is None:
        return acc, np.asarray(e_acc, np.int64)
    eb = scalar_exp(bias, "bias")
    shape = [1] * acc.ndim
    shape[axis] = acc.shape[axis]
    b = i64(bias.m).reshape(shape)
    keys = [site_key(ctx, tid, 1), site_key(ctx, tid, 2)]
    terms = [(acc, e_acc, product_bits(k)), (b, eb, MAG)]
    return aligned_sum_fast(terms, ctx.rounding, keys, [row_offset(acc, ctx.rows), 0])


def linear_accumulate(x: MX, w: MX, bias: MX | None, ctx: RoundCtx, tid: int) -> Acc:
    """linear_forward before its output compaction: the int32 accumulator x @ w^T (+ b aligned,
    sites 1/2; site 3 pre-shift of x if product_cap(K, 8) < 0), shape x.shape[:-1] + (O,)."""
    ex, ew = scalar_exp(x, "linear input"), scalar_exp(w, "linear weight")
    k = w.shape[1]
    x2 = x.m.reshape(-1, k)
    xm, ex = fit_product(x2, ex, k, ctx, site_key(ctx, tid, 3), row_offset(x2, ctx.rows))
    acc = int_matmul(xm, i64(w.m).T)
    acc, e = add_bias(acc, ex + ew, k, bias, 1, ctx, tid)
    return Acc(acc.reshape(x.shape[:-1] + (w.shape[0],)), e)


def linear_forward(x: MX, w: MX, bias: MX | None, ctx: RoundCtx, tid: int) -> MX:
    """y[..., o] = sum_k x[..., k] w[o, k] (+ b[o]).

    Sites: 0 output compaction, 1/2 bias alignment (acc, bias), 3 pre-shift of x if
    product_cap(K, 8) < 0. Exponent of the accumulator: e_x + e_w.
    """
    acc = linear_accumulate(x, w, bias, ctx, tid)
    return compact_mx(acc.a, acc.e, ctx, site_key(ctx, tid, 0), batch=True)


def linear_backward_input(dy: MX, w: MX, ctx: RoundCtx, tid: int) -> MX:
    """dx = dy @ w. Sites: 0 compaction, 3 pre-shift of dy if product_cap(O, 8) < 0."""
    ed, ew = scalar_exp(dy, "dy"), scalar_exp(w, "linear weight")
    o = w.shape[0]
    d2 = dy.m.reshape(-1, o)
    dm, ed = fit_product(d2, ed, o, ctx, site_key(ctx, tid, 3), row_offset(d2, ctx.rows))
    acc = int_matmul(dm, i64(w.m)).reshape(dy.shape[:-1] + (w.shape[1],))
    # compacted in the rows view the op's rule passes (ops.common.rows: (rows, K)), as the
    # forward: channel exponents (numerics §5) group a linear layer's values by feature
    return compact_mx(acc, ed + ew, ctx, site_key(ctx, tid, 0), batch=True)


def linear_backward_weight(dy: MX, x: MX, ctx: RoundCtx | None = None, tid: int = 0) -> Acc:
    """dW = dy^T @ x as an un-compacted int32 accumulator, exponent e_dy + e_x.

    If product_cap(N, 8) < 0 (N = rows), dy is pre-shifted (site 3; nearest without ctx). With
    ctx.rows, N counts every data-parallel worker's rows and the result is this worker's
    share of the sum (an ALL_REDUCE node adds the shares).
    """
    ed, ex = scalar_exp(dy, "dy"), scalar_exp(x, "x")
    o, k = dy.shape[-1], x.shape[-1]
    d2 = dy.m.reshape(-1, o)
    key = site_key(ctx, tid, 3) if ctx is not None else 0
    rows = ctx.rows if ctx is not None else None
    dm, ed = fit_product(d2, ed, global_rows(d2.shape[0], rows), ctx, key, row_offset(d2, rows))
    acc = int_matmul(dm.T, i64(x.m.reshape(-1, k)))
    return Acc(acc, np.asarray(ed + ex, np.int64))


def bias_backward(dy: MX, axes: tuple[int, ...]) -> Acc:
    """db = sum of dy over `axes` (int32 accumulator, exponent e_dy)."""
    ed = scalar_exp(dy, "dy")
    acc = i64(dy.m).sum(axis=axes)
    check_int32(acc, "bias_backward")
    return Acc(acc, np.asarray(ed, np.int64))
