"""ReLU, ReLU6, clamp (Hardtanh), LeakyReLU, Hardswish, Hardsigmoid, sigmoid, SiLU, tanh and
Mish, and their gradients."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mexc.kernels._common import (
    compact_mx,
    fast_compact_to_bits,
    i64,
    row_offset,
    scalar_exp,
    site_key,
)
from mexc.mx import MX, RoundCtx
from mexc.numerics import (
    MISH_GRAD_TABLE,
    MISH_TABLE,
    SIGMOID_GRAD_TABLE,
    SIGMOID_TABLE,
    SILU_GRAD_TABLE,
    TANH_GRAD_TABLE,
    TANH_TABLE,
    FixedScalar,
    LookupTable,
    Reciprocal,
    div_const,
    offset_tables,
    shift_right,
)


def relu_forward(x: MX) -> MX:
    """y = max(m, 0), same exponent."""
    return MX(np.maximum(x.m, 0).astype(np.int8), x.e)


def _mask(x_or_mask: MX | np.ndarray) -> np.ndarray:
    if isinstance(x_or_mask, MX):
        return x_or_mask.m > 0
    return np.asarray(x_or_mask, dtype=bool)


def relu_backward(dy: MX, x_or_mask: MX | np.ndarray) -> MX:
    """dx = dy where x > 0 (x = the ReLU input or output, or a boolean mask), else 0."""
    dm = np.asarray(dy.m)
    if dm.dtype == np.int8:
        mask = _mask(x_or_mask)
        if mask.shape == dm.shape:
            out = np.negative(mask.view(np.int8))  # 0 / -1 (all bits set): a new array
            out &= dm
            return MX(out, dy.e)
    return MX(np.where(_mask(x_or_mask), dy.m, 0).astype(np.int8), dy.e)


def relu6_cap(e: int, qmax_: int = 127) -> int:
    """Largest mantissa c with c * 2^e <= 6, clipped to qmax: min(6 << -e, qmax) for e < 0,
    6 >> e for e >= 0."""
    if e >= 0:
        return min(6 >> min(e, 62), qmax_)
    return min(6 << min(-e, 40), qmax_)


def relu6_forward(x: MX) -> MX:
    """y = clip(m, 0, c) with c = relu6_cap(e); same exponent."""
    e = scalar_exp(x, "relu6 input")
    return MX(np.clip(x.m, 0, relu6_cap(e)).astype(np.int8), x.e)


def relu6_backward(dy: MX, x: MX) -> MX:
    """dx = dy where 0 < x < 6 (x = the ReLU6 input), compared exactly as m * 2^e < 6."""
    e = scalar_exp(x, "relu6 input")
    m = i64(x.m)  # |m| <= 127 < 6 << 5 and 1 << 3 > 6, so shifts of 8 decide every case
    keep = (m > 0) & ((m << min(max(e, 0), 8)) < (6 << min(max(-e, 0), 8)))
    return MX(np.where(keep, dy.m, 0).astype(np.int8), dy.e)


# ----------------------------------------------------------------------------- clamp

CLAMP_MAX_BOUND = 2.0**15  # FixedScalar's 15-bit numerator at shift 0
CLAMP_LEFT_CAP = 16  # a bound's mantissa num 2^t saturates at t = 16: |.| < 2^31, past any m


def clamp_bound(v: float) -> tuple[int, int]:
    """A clamp bound as num 2^-shift: FixedScalar.of(|v|) (15-bit numerator; exact for dyadic
    bounds such as 0, 1, 6 or 0.5), signed."""
    if not math.isfinite(v) or abs(v) >= CLAMP_MAX_BOUND:
        raise ValueError(f"clamp bound must be finite and below 2^15 in magnitude: {v}")
    f = FixedScalar.signed(v)
    return f.num, f.shift


def bound_mantissa(bound: tuple[int, int], e: int, ceil: bool) -> int:
    """floor (ceil) of the bound over 2^e, num 2^(-shift - e): a left shift saturating at
    2^16 (past every int8 mantissa, so comparisons with one stay exact), or an arithmetic right
    shift (floor; ceil as -floor(-num / 2^k)) of at most 31."""
    num, shift = bound
    t = -shift - e
    if t >= 0:
        return num << min(t, CLAMP_LEFT_CAP)
    k = min(-t, 31)
    return -((-num) >> k) if ceil else num >> k


def clamp_bounds(attrs: Any) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The (lo, hi) bounds of a clamp node's attributes (lo, hi, has_lo, has_hi) as
    clamp_bound pairs (None: absent)."""
    lo = clamp_bound(float(attrs.lo)) if attrs.has_lo else None
    return lo, (clamp_bound(float(attrs.hi)) if attrs.has_hi else None)


def clamp_forward(x: MX, lo: tuple[int, int] | None, hi: tuple[int, int] | None, top: int) -> MX:
    """y = min(max(m, L), H), the exponent kept: L = min(ceil(lo / 2^e), top), H =
    max(floor(hi / 2^e), -top) (top: the largest activation mantissa), an absent bound none.
    lo > hi gives hi everywhere, as torch.clamp."""
    e = scalar_exp(x, "clamp input")
    m = i64(x.m)
    if lo is not None:
        m = np.maximum(m, min(bound_mantissa(lo, e, True), top))
    if hi is not None:
        m = np.minimum(m, max(bound_mantissa(hi, e, False), -top))
    return MX(m.astype(np.int8), x.e)


def clamp_backward(dy: MX, x: MX, lo: tuple[int, int] | None, hi: tuple[int, int] | None) -> MX:
    """dx = dy where lo < x < hi strictly (torch's clamp and Hardtanh gradients: 0 at the bounds
    themselves), decided exactly on the input's mantissa: x > lo iff m > floor(lo / 2^e), x < hi
    iff m < ceil(hi / 2^e)."""
    e = scalar_exp(x, "clamp input")
    m = i64(x.m)
    keep = np.ones(m.shape, bool)
    if lo is not None:
        keep &= m > bound_mantissa(lo, e, False)
    if hi is not None:
        keep &= m < bound_mantissa(hi, e, True)
    return MX(np.where(keep, dy.m, 0).astype(np.int8), dy.e)


# ----------------------------------------------------------------------------- leaky relu

# m 2^S < 2^31 for every int8 m (channel exponents' frames hold mantissas up to 127)
LEAKY_MAX_SHIFT = 23
LEAKY_MAX_SLOPE = 2.0**15  # FixedScalar's 15-bit numerator at shift 0


def leaky_slope(slope: float) -> tuple[int, int]:
    """(num, S): LeakyReLU's negative slope as num 2^-S, the host constant of its kernels.
    |slope| as FixedScalar (15-bit numerator); where that shift passes 23, num = round(|slope|
    2^23) at S = 23 (a slope below 2^-24 acts as 0); num negated for a negative slope."""
    if not math.isfinite(slope) or abs(slope) >= LEAKY_MAX_SLOPE:
        raise ValueError(f"LeakyReLU slope must be finite and below 2^15 in magnitude: {slope}")
    if slope == 0:
        return 0, 0
    f = FixedScalar.of(abs(slope))
    num, shift = f.num, f.shift
    if shift > LEAKY_MAX_SHIFT:
        num, shift = int(math.floor(abs(slope) * 2.0**LEAKY_MAX_SHIFT + 0.5)), LEAKY_MAX_SHIFT
    return (-num if slope < 0 else num), shift


def _leaky(v: MX, mask: np.ndarray, slope: float, name: str, ctx: RoundCtx, tid: int) -> MX:
    """acc = m 2^S where the mask's mantissa is > 0, m num elsewhere ((num, S) = leaky_slope;
    |acc| < 2^30), at e - S; compaction (site 0): the forward (v = mask = x) and backward."""
    e = scalar_exp(v, name)
    num, s = leaky_slope(slope)
    m = i64(v.m)
    acc = np.where(np.asarray(mask) > 0, m * (1 << s), m * num)
    return compact_mx(acc, e - s, ctx, site_key(ctx, tid, 0), batch=True)


def leaky_relu_forward(x: MX, slope: float, ctx: RoundCtx, tid: int) -> MX:
    """y = x where x > 0, slope x elsewhere (torch.nn.LeakyReLU): _leaky of x masked by x."""
    return _leaky(x, x.m, slope, "leaky_relu input", ctx, tid)


def leaky_relu_backward(dy: MX, saved: MX, slope: float, ctx: RoundCtx, tid: int) -> MX:
    """dx = dy where saved > 0, slope dy elsewhere: _leaky of dy masked by `saved`, the output
    y for a slope >= 0 (y > 0 where x > 0, unless the compaction rounded x to 0: the slope
    then, torch's derivative at 0), the input x for a negative slope."""
    return _leaky(dy, saved.m, slope, "dy", ctx, tid)


# ----------------------------------------------------------------------------- hardswish

HS_GRID = 16  # K: x + 3 is clamped on the 2^-k grid, k = clamp(-e, 0, K) (docs/layers.md)
HS_DIVISOR = 6


def _hardswish_grid(m: np.ndarray, e: int) -> tuple[np.ndarray, int]:
    """(xk, k): the input on the 2^-k grid, k = clamp(-e, 0, K). Shifts left by at most 3 (|x|
    >= 8 saturates the clamp either way); below 2^-K the input rounds to nearest on the grid."""
    k = min(max(-e, 0), HS_GRID)
    s = k + e
    if s >= 0:
        return i64(m) << min(s, 3), k
    return shift_right(i64(m), -s, "nearest"), k


def _divide_by_six(acc: np.ndarray, e: int, ctx: RoundCtx, tid: int) -> MX:
    """acc 2^e / 6: compact_to_bits(acc, 15) (site 0), div_const by 6, compaction (site 1)."""
    a, ea = fast_compact_to_bits(acc, e, 15, ctx.rounding, site_key(ctx, tid, 0), ctx.rows)
    q, eq = div_const(a, ea, Reciprocal.of(HS_DIVISOR))
    return compact_mx(q, eq, ctx, site_key(ctx, tid, 1), batch=True)


def hardswish_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    """y = x relu6(x + 3) / 6: acc = (m c) << max(0, 5 - k) with c = clamp(xk + 3 2^k, 0,
    6 2^k), then _divide_by_six (sites 0, 1)."""
    e = scalar_exp(x, "hardswish input")
    xk, k = _hardswish_grid(x.m, e)
    c = np.clip(xk + (3 << k), 0, 6 << k)
    left = max(0, 5 - k)
    return _divide_by_six((i64(x.m) * c) << left, e - k - left, ctx, tid)


def hardswish_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    """dx = dy g(x), g = 0 (x <= -3), 1 (x >= 3), (2x + 3) / 6 between: acc = (m_dy G) <<
    max(0, 4 - k) with G = 6 g 2^k on the grid, then _divide_by_six (sites 0, 1)."""
    e = scalar_exp(x, "hardswish input")
    ed = scalar_exp(dy, "dy")
    xk, k = _hardswish_grid(x.m, e)
    three = 3 << k
    g = np.where(xk <= -three, 0, np.where(xk >= three, 2 * three, 2 * xk + three))
    left = max(0, 4 - k)
    return _divide_by_six((i64(dy.m) * g) << left, ed - k - left, ctx, tid)


# ----------------------------------------------------------------------------- hardsigmoid

HSIG_BITS = 12  # relu6(x + 3) on the 2^-k grid is shifted up to 6 2^12 < 2^15 before / 6
HSIG_GRAD_LEFT = 8  # dy << 8 < 2^15: the division by 6 keeps dy's 7 bits


def hardsigmoid_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    """y = relu6(x + 3) / 6: acc = c << max(0, 12 - k) with c = clamp(xk + 3 2^k, 0, 6 2^k)
    on hardswish's grid, then _divide_by_six (sites 0, 1)."""
    e = scalar_exp(x, "hardsigmoid input")
    xk, k = _hardswish_grid(x.m, e)
    c = np.clip(xk + (3 << k), 0, 6 << k)
    left = max(0, HSIG_BITS - k)
    return _divide_by_six(c << left, -k - left, ctx, tid)


def hardsigmoid_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    """dx = dy / 6 strictly inside (-3, 3), else 0 (torch's hardsigmoid_backward), decided
    exactly on the grid: acc = (m_dy << 8) where -3 2^k < xk < 3 2^k, then _divide_by_six
    (sites 0, 1)."""
    e = scalar_exp(x, "hardsigmoid input")
    ed = scalar_exp(dy, "dy")
    xk, k = _hardswish_grid(x.m, e)
    three = 3 << k
    inside = (xk > -three) & (xk < three)
    acc = np.where(inside, i64(dy.m) << HSIG_GRAD_LEFT, 0)
    return _divide_by_six(acc, ed - HSIG_GRAD_LEFT, ctx, tid)


# ----------------------------------------------------------------------------- sigmoid, SiLU


def table_product(a: MX | None, x: MX, table: LookupTable, ctx: RoundCtx, tid: int) -> MX:
    """a times table(x) (a None: table(x) alone): the table's index is x shifted to its
    in_exp (site 0, PRNG index = x's flat index; saturating, clamped); acc = m_a T (|.| <
    2^22) at e_a + out_exp; compaction (site 1). Sigmoid is table_product(None, x,
    SIGMOID_TABLE), SiLU table_product(x, x, SIGMOID_TABLE); their gradients
    table_product(dy, x, SIGMOID_GRAD_TABLE | SILU_GRAD_TABLE)."""
    ex = scalar_exp(x, f"{table.name} input")
    start = row_offset(x.m, ctx.rows)
    t = table.lookup(i64(x.m), ex, ctx.rounding, site_key(ctx, tid, 0), start)
    if a is None:
        return compact_mx(t, table.out_exp, ctx, site_key(ctx, tid, 1), batch=True)
    ea = scalar_exp(a, "factor")
    acc = i64(a.m) * t
    return compact_mx(acc, ea + table.out_exp, ctx, site_key(ctx, tid, 1), batch=True)


def sigmoid_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(None, x, SIGMOID_TABLE, ctx, tid)


def sigmoid_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(dy, x, SIGMOID_GRAD_TABLE, ctx, tid)


def silu_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(x, x, SIGMOID_TABLE, ctx, tid)


def silu_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(dy, x, SILU_GRAD_TABLE, ctx, tid)


def tanh_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(None, x, TANH_TABLE, ctx, tid)


def tanh_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(dy, x, TANH_GRAD_TABLE, ctx, tid)


def mish_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(x, x, MISH_TABLE, ctx, tid)


def mish_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    return table_product(dy, x, MISH_GRAD_TABLE, ctx, tid)


def offset_forward(x: MX, fn: str, params: tuple[float, ...], ctx: RoundCtx, tid: int) -> MX:
    """The offset of relu(x) + offset(x) (ELU, CELU, Softplus): a table of x alone."""
    return table_product(None, x, offset_tables(fn, params)[0], ctx, tid)


def offset_backward(
    dy: MX, x: MX, fn: str, params: tuple[float, ...], ctx: RoundCtx, tid: int
) -> MX:
    return table_product(dy, x, offset_tables(fn, params)[1], ctx, tid)
