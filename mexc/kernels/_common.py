"""Shared helpers of the reference kernels (exact integer arithmetic on numpy int64 arrays).

Conventions used by every kernel (docs/layers.md):
- Static bounds assume an int8 mantissa container: |m| <= 127 < 2^MAG, whatever ctx.bits is.
- Rounding site j of a kernel called with base id `tid` uses the key ctx.key(tid + j).
"""

from __future__ import annotations

import numpy as np

from mexc.mx import MX, SITES_PER_NODE, RoundCtx
from mexc.numerics import (
    Rounding,
    ceil_log2,
    check_int32,
    compact,
    compaction_shift,
    expand_exponent,
    product_cap,
    saturate,
    shift_right,
    shift_signed,
)

MAG = 7  # |int8 mantissa| <= 127 < 2^7
INT8_BITS = 8  # the bits used by the static caps (int8 container)


def site_key(ctx: RoundCtx, tid: int, j: int) -> int:
    """Key of rounding site j (0 <= j < 16) of the kernel with base id `tid`."""
    if not 0 <= j < SITES_PER_NODE:
        raise ValueError(f"rounding site {j} out of range")
    return ctx.key(tid + j)


def scalar_exp(x: MX, what: str) -> int:
    """The single exponent of a per-tensor MX value."""
    if x.e.ndim != 0:
        raise ValueError(f"{what} needs a per-tensor exponent, got shape {x.e.shape}")
    return int(x.e)


def i64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def bit_length(v: np.ndarray) -> np.ndarray:
    """Elementwise bit length of |v| (count-leading-zeros form, exact integer)."""
    a = np.abs(i64(v))
    powers = np.int64(1) << np.arange(63, dtype=np.int64)
    return (a[..., None] >= powers).sum(axis=-1).astype(np.int64)


def compact_mx(acc: np.ndarray, e: np.ndarray | int, ctx: RoundCtx, key: int) -> MX:
    """numerics.compact with the context's bits and rounding, per tensor."""
    m, e2 = compact(i64(acc), e, ctx.bits, ctx.rounding, key)
    return MX.of(m, e2)


def compact_common(acc: np.ndarray, e_grp: np.ndarray, axis: int, ctx: RoundCtx, key: int) -> MX:
    """Compact an accumulator whose exponent differs per index along `axis` to one exponent.

    s_g = compaction_shift(max|acc_g|); e_out = max over non-zero groups of (e_g + s_g) (max e_g if
    all are zero); every group is right-shifted by e_out - e_g >= s_g with one rounding (key),
    so every result fits qmax.
    """
    a = i64(acc)
    check_int32(a, "compact")
    eg = i64(e_grp)
    moved = np.moveaxis(np.abs(a), axis, 0).reshape(a.shape[axis], -1)
    amax = moved.max(axis=1) if moved.size else np.zeros(a.shape[axis], np.int64)
    s = compaction_shift(amax, ctx.bits)
    cand = eg + s
    e_out = int(cand[amax > 0].max()) if np.any(amax > 0) else int(eg.max())
    shape = [1] * a.ndim
    shape[axis] = a.shape[axis]
    sh = np.broadcast_to((e_out - eg).reshape(shape), a.shape)
    out = shift_right(a, sh, ctx.rounding, key)
    return MX.of(saturate(out, ctx.bits), e_out)


def aligned_sum_fast(
    terms: list[tuple[np.ndarray, np.ndarray | int, int]],
    rounding: Rounding,
    keys: list[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Bit-identical to numerics.aligned_sum, but skips terms whose shift is all zero.

    (shift_right by 0 returns its input exactly, so skipping it changes no bit; it saves the
    PRNG evaluation over a large tensor.)
    """
    m = len(terms)
    ndim = max(np.ndim(x) for x, _, _ in terms)
    exps = [expand_exponent(e, max(ndim, np.ndim(e))) for _, e, _ in terms]
    e_min = exps[0]
    e_top = exps[0] + terms[0][2]
    for (_, _, b), e in zip(terms[1:], exps[1:]):
        e_min = np.minimum(e_min, e)
        e_top = np.maximum(e_top, e + b)
    target = np.maximum(e_min, e_top + ceil_log2(m) - 31)
    total: np.ndarray | None = None
    for i, ((x, _, _), e) in enumerate(zip(terms, exps)):
        xv = i64(x)
        sh = np.broadcast_to(target - e, np.shape(x))
        aligned = xv if not np.any(sh) else shift_signed(xv, sh, rounding, keys[i])
        total = aligned if total is None else total + aligned
    assert total is not None
    check_int32(total, "aligned_sum")
    return total, target


def fit_product(
    a: np.ndarray, e_a: int, k: int, ctx: RoundCtx | None, key: int
) -> tuple[np.ndarray, int]:
    """Pre-shift operand `a` when the K-wide int8 x int8 product cap is negative.

    cap = product_cap(K, 8); if cap < 0, a <- round(a / 2^-cap) (ctx rounding with `key`, nearest
    without ctx) and its exponent grows by -cap. Then K * |a| * 127 < 2^31.
    """
    cap = product_cap(k, INT8_BITS)
    if cap >= 0:
        return i64(a), e_a
    rounding: Rounding = ctx.rounding if ctx is not None else "nearest"
    return shift_right(i64(a), -cap, rounding, key), e_a + (-cap)


def product_bits(k: int) -> int:
    """Static magnitude bits of a K-wide int8 x int8 inner product: |acc| < 2^(14 + ceil log2 K)."""
    return 2 * MAG + ceil_log2(max(k, 1))
