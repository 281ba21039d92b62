"""Residual add, gradient accumulation and dropout."""

from __future__ import annotations

import numpy as np

from mexc.kernels._common import (
    MAG,
    align_term,
    aligned_sum_fast,
    compact_mx,
    global_rows,
    i64,
    row_offset,
    scalar_exp,
    site_key,
)
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import (
    FixedScalar,
    ceil_log2,
    check_int32,
    element_bits,
    expand_exponent,
    magnitude_bits,
    shift_right,
    shift_signed,
)

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
    starts = [row_offset(t.m, ctx.rows) for t in terms]
    acc, e = aligned_sum_fast([(i64(t.m), t.e, MAG) for t in terms], ctx.rounding, keys, starts)
    return compact_mx(acc, e, ctx, site_key(ctx, tid, len(terms)), batch=True)


def param_grad_sum(terms: list[Acc], ctx: RoundCtx, tid: int) -> Acc:
    """The gradient of a parameter read by T <= 13 ops: their int32 accumulators added as an
    aligned sum whose bound for term i is the bit length of its largest magnitude, all-zero
    terms left out (docs/numerics.md §7c); term i at site i; an accumulator."""
    if not 2 <= len(terms) <= MAX_SUM_TERMS:
        raise ValueError(f"param_grad_sum takes 2..{MAX_SUM_TERMS} terms, got {len(terms)}")
    values = [i64(t.a) for t in terms]
    exps = [np.asarray(t.e) for t in terms]
    bits = [magnitude_bits(np.abs(v).max(initial=0)) for v in values]
    live = [i for i, b in enumerate(bits) if b > 0]
    if not live:  # every reader's gradient is zero: so is the sum, at the lowest exponent
        low = exps[0]
        for e in exps[1:]:
            low = np.minimum(low, e)
        return Acc(np.zeros_like(values[0]), low)
    low, top = exps[live[0]], exps[live[0]] + bits[live[0]]
    for i in live[1:]:
        low, top = np.minimum(low, exps[i]), np.maximum(top, exps[i] + bits[i])
    target = np.maximum(low, top + len(terms).bit_length() - 31)
    total = np.zeros(np.broadcast_shapes(*(v.shape for v in values)), np.int64)
    for i in live:
        sh = expand_exponent(target - exps[i], values[i].ndim)
        total = total + align_term(values[i], sh, ctx.rounding, site_key(ctx, tid, i))
    check_int32(total, "param_grad_sum")
    return Acc(total, target)


def _keep_threshold(p: FixedScalar) -> int:
    """Keep iff word < 2^32 - round(p * 2^32) (p = num * 2^-shift; drop count rounds down)."""
    drop = p.num << (32 - p.shift) if p.shift <= 32 else p.num >> (p.shift - 32)
    return max((1 << 32) - drop, 0)


def dropout_scale(p: FixedScalar) -> FixedScalar:
    """1 / (1 - p) as a 15-bit num/shift (host constant)."""
    return FixedScalar.of(1.0 / (1.0 - float(p)))


DROPOUT_MODES = ("element", "row", "batch")


def dropout_group(shape: tuple[int, ...], mode: str) -> int:
    """Elements per keep decision: 1 (dropout), a channel of a sample (Dropout1d/2d/3d:
    "channel"), a sample (stochastic depth, torchvision's "row" mode), or the whole batch
    ("batch")."""
    size = int(np.prod(shape, dtype=np.int64))
    if mode == "channel":
        return size // max(shape[0] * shape[1], 1)
    return {"element": 1, "row": size // max(shape[0], 1), "batch": size}[mode]


def dropout_forward(
    x: MX, p: FixedScalar | float, ctx: RoundCtx, tid: int, per: int = 1, whole: bool = False
) -> tuple[MX, np.ndarray]:
    """Inverted dropout. mask = element_bits(key site 0, size / per) < 2^32 - p*2^32 (uint32
    compare), word j deciding elements [j per, (j + 1) per) (per = dropout_group: 1 for
    dropout, a sample for stochastic depth); y = compact(m * mask * s.num) at exponent e -
    s.shift (site 1), s = FixedScalar(1/(1-p)). `whole`: one decision for the whole batch
    ("batch" mode: word 0 on every data-parallel worker)."""
    pf = p if isinstance(p, FixedScalar) else FixedScalar.of(float(p))
    if float(pf) >= 1.0:
        raise ValueError("dropout probability must be < 1")
    size = int(np.prod(x.shape, dtype=np.int64))
    # a data-parallel worker's first decision is the whole batch's word start / per
    first = 0 if whole else row_offset(x.m, ctx.rows) // per
    words = element_bits(site_key(ctx, tid, 0), (size // per,), first).astype(np.int64)
    words = np.repeat(words, per).reshape(x.shape)
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
    return compact_mx(acc, x.e - s.shift, ctx, key, batch=True)


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
    acc = shift_signed(m, s, ctx.rounding, site_key(ctx, tid, 0), row_offset(m, ctx.rows))
    return compact_mx(acc, target, ctx, site_key(ctx, tid, 1), batch=True)


# ----------------------------------------------------------------------------- products


MUL_SUM_BITS = 15  # |dy_m x_m| < 2^14, plus a bit for the rounded-up shifted products


def mul_grad_shift(terms: int) -> int:
    """The right shift of each product dy_m x_m before a sum of `terms` of them, so that the
    sum stays inside int32 (0 below 2^16 terms)."""
    return max(0, MUL_SUM_BITS + ceil_log2(max(terms, 1)) - 31)


def mul_forward(x: MX, g: MX, ctx: RoundCtx, tid: int) -> MX:
    """x * g, g broadcast against x (numpy rules; g may equal x's shape): acc = m_x m_g (< 2^14,
    exact) at e_x + e_g, compaction (site 0). dx of a product is mul_forward(dy, g)."""
    ex, eg = scalar_exp(x, "mul input"), scalar_exp(g, "mul factor")
    acc = np.broadcast_to(i64(x.m) * i64(g.m), x.m.shape)
    return compact_mx(acc, ex + eg, ctx, site_key(ctx, tid, 0), batch=True)


DIV_BITS = 15  # the quotient of the mantissas is taken to 2^-15 before its compaction


def div_forward(a: MX, b: MX, ctx: RoundCtx, tid: int) -> MX:
    """a / b of equal shapes: acc = sign(m_a m_b) floor((|m_a| 2^15 + floor(|m_b| / 2)) /
    |m_b|) (idiv_round, |acc| < 2^22), and m_a 2^16 where m_b = 0 (b below half its unit,
    taken as half a unit, positive), at e_a - e_b - 15; compaction (site 0). da =
    div_forward(dy, b); db = -div_forward(dy q, b), q the result."""
    ea, eb = scalar_exp(a, "dividend"), scalar_exp(b, "divisor")
    ma, mb = i64(a.m), i64(b.m)
    if ma.shape != mb.shape:
        raise ValueError(f"div_forward needs equal shapes, got {ma.shape} and {mb.shape}")
    den = np.abs(mb)
    q = (np.abs(ma) << DIV_BITS) + den // 2
    quotient = np.sign(ma) * np.sign(mb) * (q // np.maximum(den, 1))
    acc = np.where(den == 0, ma << (DIV_BITS + 1), quotient)
    return compact_mx(acc, ea - eb - DIV_BITS, ctx, site_key(ctx, tid, 0), batch=True)


def broadcast_axes(x_shape: tuple[int, ...], g_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of x_shape that a factor of g_shape is broadcast along (numpy rules)."""
    pad = (1,) * (len(x_shape) - len(g_shape)) + tuple(g_shape)
    return tuple(i for i, (a, b) in enumerate(zip(x_shape, pad)) if b == 1 and a != 1)


def mul_backward_factor(
    dy: MX, x: MX, g_shape: tuple[int, ...], ctx: RoundCtx, tid: int, param: bool
) -> MX | Acc:
    """dg of y = x * g: the sum of dy_m x_m over the axes g is broadcast along (R terms), each
    product first shifted right by t = mul_grad_shift(R) (site 1, PRNG index = x's flat index;
    t = 0 for R < 2^16), at e_dy + e_x + t. A parameter's gradient is that int32 accumulator
    (for the update); an activation's is compacted (site 0)."""
    ed, ex = scalar_exp(dy, "dy"), scalar_exp(x, "mul input")
    # the whole batch's shape decides the axes and the count (ctx.rows: this worker's rows)
    whole = (global_rows(x.m.shape[0], ctx.rows), *x.m.shape[1:])
    axes = broadcast_axes(whole, g_shape)
    terms = int(np.prod([whole[a] for a in axes], dtype=np.int64))
    t = mul_grad_shift(terms)
    prod = i64(dy.m) * i64(x.m)
    if t:
        start = row_offset(prod, ctx.rows)
        prod = shift_right(prod, t, ctx.rounding, site_key(ctx, tid, 1), start)
    acc = prod.sum(axis=axes, keepdims=True).reshape(g_shape)
    check_int32(acc, "mul_backward_factor")
    if param:  # with ctx.rows: this worker's share (an ALL_REDUCE adds them)
        return Acc(acc, np.asarray(ed + ex + t, np.int64))
    return compact_mx(acc, ed + ex + t, ctx, site_key(ctx, tid, 0), batch=True)


def factor_view(x_shape: tuple[int, ...], g_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(O, M, I) such that x seen as (O, M, I) multiplies a factor seen as (M,) along its middle
    axis (SE gating [N, C, 1, 1]: (1, N C, H W); a layer scale [C, 1, 1]: (N, C, H W); channels
    last [C]: (N H W, C, 1); equal shapes: (1, size, 1)); None where the factor's own axes are
    not contiguous in x (a [N, 1, H, W] factor) or do not broadcast."""
    pad = (1,) * (len(x_shape) - len(g_shape)) + tuple(g_shape)
    if len(pad) != len(x_shape) or any(b not in (1, a) for a, b in zip(x_shape, pad)):
        return None
    own = [i for i, (a, b) in enumerate(zip(x_shape, pad)) if a != 1 and b == a]
    if not own:
        return (int(np.prod(x_shape, dtype=np.int64)), 1, 1)
    lo, hi = own[0], own[-1]
    if any(pad[i] == 1 and x_shape[i] != 1 for i in range(lo, hi + 1)):
        return None
    prod = lambda axes: int(np.prod([x_shape[i] for i in axes], dtype=np.int64))  # noqa: E731
    return prod(range(lo)), prod(range(lo, hi + 1)), prod(range(hi + 1, len(x_shape)))
