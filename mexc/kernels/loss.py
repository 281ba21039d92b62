"""Output head: integer softmax + cross-entropy (15-bit probabilities in int16, exponent -15)."""

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

PROB_BITS = 15
PROB_EXP = -PROB_BITS  # probabilities p * 2^-15, p in [0, 2^15 - 1], held in int16
PROB_ONE = 1 << PROB_BITS
PROB_DTYPE = "int16"  # how every backend holds p
MAX_CLASSES = 1 << 16  # fewer: a row's sum of E <= 2^15 each stays below 2^31
GRAD_EXP = -15  # (p - S*onehot) / n lies at exponent -15 (then -15 - grad_shift)
LOSS_GAP_EXP = -16  # the label's gap below the row's maximum, as the logged loss reads it
LOSS_GAP_SHIFT_MAX = 31  # 1 << 31 > 2^31 - 1: every larger left shift saturates alike


def grad_shift(n: int, k: int) -> int:
    """The loss gradient's extra bits s over n rows of k classes (docs/layers.md, "Output
    head"): ceil_log2(n), so that t/n keeps t's resolution, bounded so that |t| << s < 2^31
    (|t| <= 2^15 + k // 2)."""
    room = max(31 - (PROB_ONE + k // 2).bit_length(), 0)
    return min(ceil_log2(max(n, 1)), room)


def softmax_ce_forward(
    logits: MX, labels: np.ndarray, valid: int, ctx: RoundCtx, tid: int
) -> tuple[np.ndarray, float]:
    """Row softmax of (N, K) logits as int16 p in [0, 2^15 - 1] (value p / 2^15), and the
    mean cross-entropy over the first `valid` rows as a host float (logging only).

    d = m - rowmax(m) <= 0; E = EXP_TABLE.lookup(d, e) (index = d shifted to exponent -4 with
    ctx rounding, site 0; 0 below -128, clamped to 127; values at exponent -15, E(0) = 2^15);
    S = row sum of E (int32); p = min(idiv_round(E << 15, S), 2^15 - 1).
    loss = ce_loss(loss_rows(...), valid): each row's ln(S / 2^15) minus its label's gap.
    """
    e = scalar_exp(logits, "logits")
    m = i64(logits.m)
    if m.ndim != 2:
        raise ValueError("softmax_ce needs (N, K) logits")
    d = m - m.max(axis=1, keepdims=True)
    start = row_offset(d, ctx.rows)
    ex = EXP_TABLE.lookup(d, e, ctx.rounding, site_key(ctx, tid, 0), start, flush=True)
    srow = ex.sum(axis=1, keepdims=True)
    check_int32(srow, "softmax_sum")
    num = shift_left(ex, PROB_BITS, "softmax_num")
    p = np.minimum(idiv_round(num, srow), PROB_ONE - 1).astype(PROB_DTYPE)
    rows = loss_rows(srow[:, 0], d, labels, e)
    if ctx.rows is not None:  # the logged loss is that of the whole batch, on every worker
        return p, ce_loss(ctx.rows.comm.all_gather(rows), valid)
    return p, ce_loss(rows, valid)


def label_gap(d_y: np.ndarray, e: int) -> np.ndarray:
    """A label's gap d_y <= 0 (units of 2^e below its row's maximum) at LOSS_GAP_EXP: exact
    for e >= -16 up to int32's saturation (a gap of 2^15 nats), rounded half away from zero
    below (docs/layers.md, "Output head")."""
    mag = -i64(d_y)
    s = int(e) - LOSS_GAP_EXP
    if s >= 0:
        return -np.minimum(mag << min(s, LOSS_GAP_SHIFT_MAX), 2**31 - 1)
    t = min(-s, 62)
    return -((mag + (1 << (t - 1))) >> t)


def loss_rows(srow: np.ndarray, d: np.ndarray, labels: np.ndarray, e: int) -> np.ndarray:
    """(N, 2) int32 rows [S, gap]: a row's sum of E and its label's gap d_y at LOSS_GAP_EXP
    (labels clamped to [0, K - 1], so that every row is defined), from which the host
    computes the logged loss (`ce_loss`). The kernels of every backend write these."""
    n, k = d.shape
    lab = np.clip(np.asarray(labels, np.int64).reshape(-1)[:n], 0, k - 1)
    rows = np.empty((n, 2), np.int32)
    rows[:, 0] = srow
    rows[:, 1] = label_gap(d[np.arange(n), lab], e)
    return rows


def ce_loss(rows: np.ndarray, valid: int) -> float:
    """mean_{i < valid} ln(S_i / 2^15) - gap_i 2^-16: the logged loss, a host float from the
    rows of `loss_rows`. It is -ln p_y with the label's exponential exact rather than the
    table's: a label more than 8 nats below its row's maximum (E_y = 0, p_y = 0) logs its
    gap instead of a cap. The C runtime computes the same in integer milli-nats."""
    r = np.asarray(rows, np.int64)
    n = max(min(int(valid), r.shape[0]), 0)
    if n == 0:
        return 0.0
    s, gap = np.maximum(r[:n, 0], 1).astype(np.float64), r[:n, 1].astype(np.float64)
    terms = np.log(s) - PROB_BITS * math.log(2.0) - np.ldexp(gap, LOSS_GAP_EXP)
    return float(np.mean(terms))


def softmax_ce_backward(
    probs: np.ndarray, labels: np.ndarray, valid: int, ctx: RoundCtx, tid: int
) -> MX:
    """dlogits = (softmax - onehot) / n, n = valid rows; padding rows (>= valid) are zero.

    t = p - S*onehot with S the row's sum of p, so every row of t sums to 0 as in float
    (|t| <= 2^15 + K/2); g = idiv_round(t << s, n) at exponent -15 - s (s = grad_shift: t's
    resolution kept through the division); compaction to ctx.bits
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
    g = idiv_round(t << s, max(n, 1))
    return compact_mx(g, GRAD_EXP - s, ctx, site_key(ctx, tid, 0), batch=True)
