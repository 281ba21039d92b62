"""Output head: integer softmax + cross-entropy (unsigned 8-bit probabilities, exponent -8)."""

from __future__ import annotations

import math

import numpy as np

from mexc.kernels._common import compact_mx, i64, row_offset, scalar_exp, site_key
from mexc.mx import MX, RoundCtx
from mexc.numerics import (
    EXP_TABLE,
    ceil_log2,
    check_int32,
    idiv_round,
    shift_left,
)

PROB_EXP = -8  # probabilities p * 2^-8, p in [0, 255]
PROB_ONE = 256
GRAD_EXP = -15  # (p - S*onehot) << 7 / n lies at exponent -15 (then -15 - grad_shift)


def grad_shift(n: int, k: int) -> int:
    """The loss gradient's extra bits s over n rows of k classes (docs/layers.md, "Output
    head"): ceil_log2(n) - 7 where n > 128, so that t/n keeps t's resolution, bounded so that
    |t| << (7 + s) < 2^31 (|t| <= 256 + k // 2)."""
    room = max(24 - (256 + k // 2).bit_length(), 0)
    return min(max(ceil_log2(max(n, 1)) - 7, 0), room)


def softmax_ce_forward(
    logits: MX, labels: np.ndarray, valid: int, ctx: RoundCtx, tid: int
) -> tuple[np.ndarray, float]:
    """Row softmax of (N, K) logits as integers p in [0, 255] (value p / 256), and the mean
    cross-entropy over the first `valid` rows as a host float (logging only).

    d = m - rowmax(m) <= 0; E = EXP_TABLE.lookup(d, e) (index = d shifted to exponent -4 with
    ctx rounding, site 0; clamped to [-128, 127]; values at exponent -15, E(0) = 2^15);
    S = row sum of E (int32); p = min(idiv_round(E << 8, S), 255).
    loss = mean_{i < valid} -log(max(p[i, y_i], 1) / 256).
    """
    e = scalar_exp(logits, "logits")
    m = i64(logits.m)
    if m.ndim != 2:
        raise ValueError("softmax_ce needs (N, K) logits")
    d = m - m.max(axis=1, keepdims=True)
    start = row_offset(d, ctx.rows)
    ex = EXP_TABLE.lookup(d, e, ctx.rounding, site_key(ctx, tid, 0), start)
    srow = ex.sum(axis=1, keepdims=True)
    check_int32(srow, "softmax_sum")
    p = np.minimum(idiv_round(shift_left(ex, 8, "softmax_num"), srow), PROB_ONE - 1)
    if ctx.rows is not None:  # the logged loss is that of the whole batch, on every worker
        return p, ce_loss(ctx.rows.comm.all_gather(p), ctx.rows.comm.all_gather(labels), valid)
    return p, ce_loss(p, labels, valid)


def ce_loss(probs: np.ndarray, labels: np.ndarray, valid: int) -> float:
    """mean_{i < valid} -log(max(p[i, y_i], 1) / 256): the logged loss, a host float computed
    from the integer probabilities (every backend reports the same number)."""
    lab = np.asarray(labels, np.int64)
    n = max(min(int(valid), probs.shape[0]), 0)
    if n == 0:
        return 0.0
    py = np.asarray(probs)[np.arange(n), lab[:n]]
    return float(np.mean([-math.log(max(int(v), 1) / PROB_ONE) for v in py]))


def softmax_ce_backward(
    probs: np.ndarray, labels: np.ndarray, valid: int, ctx: RoundCtx, tid: int
) -> MX:
    """dlogits = (softmax - onehot) / n, n = valid rows; padding rows (>= valid) are zero.

    t = p - S*onehot with S the row's sum of p, so every row of t sums to 0 as in float
    (|t| <= 256 + K/2); g = idiv_round(t << (7 + s), n) at exponent -15 - s (s = grad_shift:
    0 up to 128 rows); compaction to ctx.bits
    (site 0). With ctx.rows (data parallel) `valid` and n count the whole batch's rows, and
    these are its rows from the worker's first sample's on (a sample's rows: one, or one per
    position of [N, C, d1, ...] logits).
    """
    p = i64(probs)
    nrows = p.shape[0]
    rows = ctx.rows
    per = 1 if rows is None else nrows // rows.count  # rows of one sample
    n = max(min(int(valid), nrows if rows is None else rows.total * per), 0)
    first = 0 if rows is None else rows.start * per
    here = max(min(n - first, nrows), 0)  # the valid rows among these
    lab = np.asarray(labels, np.int64)
    t = p.copy()
    if here:
        t[np.arange(here), lab[:here]] -= p[:here].sum(axis=1)
    t[here:] = 0
    s = grad_shift(n, p.shape[1])
    g = idiv_round(t << (7 + s), max(n, 1))
    return compact_mx(g, GRAD_EXP - s, ctx, site_key(ctx, tid, 0), batch=True)
