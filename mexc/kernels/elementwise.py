"""Residual add, gradient accumulation and dropout."""

from __future__ import annotations

import numpy as np

from mexc.kernels._common import MAG, aligned_sum_fast, compact_mx, i64, scalar_exp, site_key
from mexc.mx import MX, RoundCtx
from mexc.numerics import FixedScalar, element_bits, shift_signed

MAX_SUM_TERMS = 13  # a sum's rounding sites: one per term, one for its compaction (of 16)


def add_forward(a: MX, b: MX, ctx: RoundCtx, tid: int) -> MX:
    """a + b: aligned_sum (sites 0 for a, 1 for b), compaction (site 2)."""
    return grad_sum([a, b], ctx, tid)


def grad_sum(terms: list[MX], ctx: RoundCtx, tid: int) -> MX:
    """Sum of T <= 13 MX tensors of one shape (per-tensor exponents): aligned_sum with site i
    for term i, compaction with site T. A single term is returned unchanged."""
    if not terms:
        raise ValueError("grad_sum needs at least one term")
    if len(terms) == 1:
        return terms[0]
    if len(terms) > MAX_SUM_TERMS:
        raise ValueError(f"grad_sum supports at most {MAX_SUM_TERMS} terms (rounding sites)")
    keys = [site_key(ctx, tid, i) for i in range(len(terms))]
    acc, e = aligned_sum_fast([(i64(t.m), t.e, MAG) for t in terms], ctx.rounding, keys)
    return compact_mx(acc, e, ctx, site_key(ctx, tid, len(terms)))


def _keep_threshold(p: FixedScalar) -> int:
    """Keep iff word < 2^32 - round(p * 2^32) (p = num * 2^-shift; drop count rounds down)."""
    drop = p.num << (32 - p.shift) if p.shift <= 32 else p.num >> (p.shift - 32)
    return max((1 << 32) - drop, 0)


def dropout_scale(p: FixedScalar) -> FixedScalar:
    """1 / (1 - p) as a 15-bit num/shift (host constant)."""
    return FixedScalar.of(1.0 / (1.0 - float(p)))


def dropout_forward(
    x: MX, p: FixedScalar | float, ctx: RoundCtx, tid: int
) -> tuple[MX, np.ndarray]:
    """Inverted dropout. mask = element_bits(key site 0, shape) < 2^32 - p*2^32 (uint32 compare);
    y = compact(m * mask * s.num) at exponent e - s.shift (site 1), s = FixedScalar(1/(1-p))."""
    pf = p if isinstance(p, FixedScalar) else FixedScalar.of(float(p))
    if float(pf) >= 1.0:
        raise ValueError("dropout probability must be < 1")
    words = element_bits(site_key(ctx, tid, 0), x.shape).astype(np.int64)
    mask = words < _keep_threshold(pf)
    return _scale_masked(x, mask, pf, ctx, site_key(ctx, tid, 1)), mask


def dropout_backward(
    dy: MX, mask: np.ndarray, p: FixedScalar | float, ctx: RoundCtx, tid: int
) -> MX:
    """dx = compact(dy * mask * s.num) at exponent e - s.shift (site 0)."""
    pf = p if isinstance(p, FixedScalar) else FixedScalar.of(float(p))
    return _scale_masked(dy, mask, pf, ctx, site_key(ctx, tid, 0))


def _scale_masked(x: MX, mask: np.ndarray, p: FixedScalar, ctx: RoundCtx, key: int) -> MX:
    s = dropout_scale(p)
    acc = np.where(mask, i64(x.m) * s.num, 0)  # |.| < 2^7 * 2^15
    return compact_mx(acc, x.e - s.shift, ctx, key)


def concat_target(exps: list[int]) -> int:
    """The exponent a concatenation aligns its inputs to: max(min e_i, max e_i + 7 - 31), the
    smallest at which every aligned int8 mantissa stays inside int32 (aligned_sum's target for
    one term per element)."""
    return max(min(exps), max(exps) + MAG - 31)


def concat_forward(xs: list[MX], dim: int, ctx: RoundCtx, tid: int) -> MX:
    """torch.cat along `dim` (docs/layers.md): each input shifted by concat_target - e_i (right
    shifts rounded, site 0, PRNG index = the output's flat index), then one compaction (site 1)."""
    exps = [scalar_exp(x, "concat input") for x in xs]
    target = concat_target(exps)
    m = np.concatenate([i64(x.m) for x in xs], axis=dim)
    s = np.concatenate(
        [np.full(x.m.shape, target - e, np.int64) for x, e in zip(xs, exps)], axis=dim
    )
    acc = shift_signed(m, s, ctx.rounding, site_key(ctx, tid, 0))
    return compact_mx(acc, target, ctx, site_key(ctx, tid, 1))
