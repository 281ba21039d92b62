"""Shared helpers of the reference kernels (exact integer arithmetic on numpy int64 arrays).

Conventions used by every kernel (docs/layers.md):
- Static bounds assume an int8 mantissa container: |m| <= 127 < 2^MAG, whatever ctx.bits is.
- Rounding site j of a kernel called with base id `tid` uses the key ctx.key(tid + j).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mexc import numerics as _numerics
from mexc.mx import MX, SITES_PER_NODE, RoundCtx, Rows
from mexc.numerics import (
    CONTAINER_BITS,
    GOLDEN32,
    Rounding,
    aligned_sum,
    ceil_log2,
    channel_compact,
    channel_shifts,
    check_int32,
    compaction_shift,
    expand_exponent,
    product_cap,
    qmax,
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


def i64(x: np.ndarray | int) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def bit_length(v: np.ndarray) -> np.ndarray:
    """Elementwise bit length of |v| (count-leading-zeros form, exact integer)."""
    a = np.abs(i64(v))
    powers = np.int64(1) << np.arange(63, dtype=np.int64)
    return (a[..., None] >= powers).sum(axis=-1).astype(np.int64)


# ----------------------------------------------------------------------------------- fast paths
# Bit-identical re-implementations of numerics.element_bits / shift_right / compact that avoid
# full-size temporaries (the reference primitives broadcast the shift and the mask to the data's
# shape). tests/kernels/test_common.py checks them against numerics on random data.

_GOLDEN_CACHE: dict[int, np.ndarray] = {}
_U32 = np.uint32


def fast_element_bits(key: int, shape: tuple[int, ...], start: int = 0) -> np.ndarray:
    """== numerics.element_bits(key, shape, start): mix32(key ^ (index * 0x9E3779B9)) per flat
    index, the indices counted from `start` (a data-parallel worker's first global element)."""
    n = int(np.prod(shape, dtype=np.int64))
    if start:
        v = np.empty(n, _U32)
        return element_bits_into(v, np.empty(n, _U32), key, start).reshape(shape)
    g = _GOLDEN_CACHE.get(n)
    if g is None:
        with np.errstate(over="ignore"):
            g = np.arange(n, dtype=_U32) * _U32(GOLDEN32)
        if n >= 1024:
            _GOLDEN_CACHE.clear()  # keep one large array at most per size in use
            _GOLDEN_CACHE[n] = g
    v = np.bitwise_xor(g, _U32(key & 0xFFFFFFFF))
    _mix32_inplace(v, np.empty_like(v))
    return v.reshape(shape)


def _mix32_inplace(v: np.ndarray, t: np.ndarray) -> None:
    """v = numerics.mix32(v) in place on a flat uint32 array, with t as same-size scratch."""
    with np.errstate(over="ignore"):
        np.right_shift(v, _U32(16), out=t)
        v ^= t
        v *= _U32(0x7FEB352D)
        np.right_shift(v, _U32(15), out=t)
        v ^= t
        v *= _U32(0x846CA68B)
        np.right_shift(v, _U32(16), out=t)
        v ^= t


def debug_on() -> bool:
    """Overflow debugging is on: fast int32 paths step aside for the checked int64 ones."""
    return bool(_numerics._DEBUG_OVERFLOW)


def round_shift32(
    x: np.ndarray,
    s: np.ndarray | int,
    amax: int,
    rounding: Rounding,
    key: int,
    out_dtype: type = np.int32,
    start: int = 0,
) -> np.ndarray | None:
    """floor((x + r) / 2^s) in int32 (== numerics.shift_right), or None if not applicable.

    x: integer array (any int dtype) with |x| <= amax; s: scalar or array broadcasting against x,
    all in 1..30. r = bits & (2^s - 1) (stochastic) or 2^(s-1) (nearest). The split form of the
    spec is only an overflow guard: when amax + 2^s - 1 < 2^31 the plain sum cannot overflow
    int32 and gives the same floor.
    """
    sv = np.asarray(s, dtype=np.int64)
    if sv.size == 0 or x.size == 0:
        return None
    smin, smax = int(sv.min()), int(sv.max())
    if smin < 0 or smax > 30 or amax + (1 << smax) - 1 >= 2**31:
        return None
    s32 = sv.astype(np.int32)
    if rounding == "stochastic":
        r = fast_element_bits(key, x.shape, start).view(np.int32)
        r &= (np.int32(1) << s32) - np.int32(1)
    elif rounding == "nearest":
        r = np.empty(x.shape, np.int32)
        r[...] = (np.int32(1) << s32) >> np.int32(1)  # 2^(s-1), 0 for s = 0
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    r += x
    r >>= s32
    return r if out_dtype is np.int32 else r.astype(out_dtype)


def abs_max(a: np.ndarray) -> int:
    return int(max(int(a.max()), -int(a.min()))) if a.size else 0


def global_abs_max(a: np.ndarray, rows: Rows | None) -> int:
    """max |a| over every data-parallel worker's rows of batch-major `a` (a's alone without)."""
    local = abs_max(np.asarray(a))
    return local if rows is None else int(rows.max(local))


def row_offset(a: np.ndarray | tuple[int, ...], rows: Rows | None) -> int:
    """The global flat index of local element 0 of batch-major `a` (0 without rows)."""
    return 0 if rows is None else rows.offset(a)


def global_rows(local: int, rows: Rows | None) -> int:
    """The whole batch's extent of a batch-major axis of `local` elements here (a count such
    as batch norm's M or a weight gradient's K takes it)."""
    return local if rows is None else rows.width(local)


def fast_shift_right(
    x: np.ndarray,
    s: np.ndarray | int,
    rounding: Rounding,
    key: int = 0,
    amax: int | None = None,
    out32: bool = False,
    start: int = 0,
) -> np.ndarray:
    """== numerics.shift_right(x, s, rounding, key, start) for s >= 0 broadcasting against x.

    amax: a known bound on |x| (else scanned when the int32 path is tried); out32: the caller
    accepts an int32 result (values are the same); start: the PRNG index of element 0."""
    sv = i64(s)
    if np.any(sv < 0):
        raise ValueError("shift_right needs s >= 0")
    xa = np.asarray(x)
    if xa.dtype.kind in "iu" and xa.size >= 4096 and not debug_on() and int(sv.max()) <= 30:
        if sv.ndim == 0 and int(sv) == 0:
            return xa.astype(np.int32 if out32 else np.int64, copy=False)
        bound = abs_max(xa) if amax is None else int(amax)
        fast = round_shift32(xa, sv, bound, rounding, key, start=start)
        if fast is not None:
            return fast if out32 else fast.astype(np.int64)
    xv = i64(x)
    check_int32(xv, "shift_right")
    if sv.ndim == 0 and int(sv) == 0:
        return xv
    if sv.ndim == 0 and int(sv) <= 30:
        return _shift32(xv, int(sv), rounding, key, start).astype(np.int64)
    small = np.minimum(sv, 31)
    mask = (np.int64(1) << small) - 1
    if rounding == "stochastic":
        r = fast_element_bits(key, xv.shape, start).astype(np.int64)
        r &= mask
    elif rounding == "nearest":
        r = np.where(small > 0, np.int64(1) << np.maximum(small - 1, 0), 0)
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    low = xv & mask
    low += r
    low >>= small
    out = xv >> small
    out += low
    if np.any(sv >= 32):
        out = np.where(sv >= 32, 0, out)
    return out


def _shift32(x: np.ndarray, s: int, rounding: Rounding, key: int, start: int = 0) -> np.ndarray:
    """shift_right for a scalar 1 <= s <= 30 computed in int32 (x holds int32 values): the inner
    sum (x & mask) + r < 2^31. Returns int32."""
    x32 = x.astype(np.int32)
    mask = np.int32((1 << s) - 1)
    if rounding == "stochastic":
        r = fast_element_bits(key, x.shape, start).view(np.int32)
        r &= mask
    elif rounding == "nearest":
        r = np.int32(1 << (s - 1))  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    low = x32 & mask
    low += r
    low >>= np.int32(s)
    x32 >>= np.int32(s)
    x32 += low
    return x32


def fast_compact(
    acc: np.ndarray,
    exponent: np.ndarray | int,
    bits: int,
    rounding: Rounding,
    key: int = 0,
    rows: Rows | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """== numerics.compact(acc, exponent, bits, rounding, key) (per tensor); with `rows`, of
    the batch-major accumulator whose rows every data-parallel worker holds a share of."""
    a = np.asarray(acc)
    if a.dtype.kind not in "iu" or debug_on():
        a = i64(a)
    check_int32(a, "compact")
    amax = global_abs_max(a, rows)
    start = row_offset(a, rows)
    s = int(compaction_shift(amax, bits))
    q = qmax(bits)
    e_out = np.asarray(exponent, dtype=np.int64) + s
    if s == 0:  # |a| <= amax <= q: saturate is the identity
        return a.astype(np.int8), e_out
    if not debug_on():
        # ceil(amax / 2^s) <= q bounds every rounding of a / 2^s: no clip needed
        out = round_shift32(a, s, amax, rounding, key, np.int8, start)
        if out is not None:
            return out, e_out
    a = i64(a)
    if 1 <= s <= 30:
        shifted = _shift32(a, s, rounding, key, start)
        np.clip(shifted, -q, q, out=shifted)
        return shifted.astype(np.int8), e_out
    out = np.clip(fast_shift_right(a, s, rounding, key, start=start), -q, q).astype(np.int8)
    return out, e_out


def compact_mx(
    acc: np.ndarray, e: np.ndarray | int, ctx: RoundCtx, key: int, batch: bool = False
) -> MX:
    """numerics.compact with the context's bits and rounding, per tensor. `batch`: acc is
    batch-major, its rows shared among the data-parallel workers of ctx.rows."""
    if batch and np.ndim(acc) >= 2 and channels_on(ctx):
        out = channel_compact_rows(acc, np.asarray(e, np.int64), 1, ctx, key)
        if out is not None:
            return out
    m, e2 = fast_compact(acc, e, ctx.bits, ctx.rounding, key, ctx.rows if batch else None)
    return MX.of(m, e2)


def channels_on(ctx: RoundCtx) -> bool:
    """Whether batch-major results get channel exponents (numerics §5; a no-op at 8 bits)."""
    return ctx.channels and ctx.bits < CONTAINER_BITS


def activation_qmax(ctx: RoundCtx) -> int:
    """The largest activation mantissa: qmax(B), or 127 under channel exponents (numerics §5)."""
    return qmax(CONTAINER_BITS) if channels_on(ctx) else qmax(ctx.bits)


def axis_abs_max(a: np.ndarray, axis: int) -> np.ndarray:
    """max |a| per index of `axis` (int64; zeros for an empty array), without an |a| copy."""
    other = tuple(i for i in range(a.ndim) if i != axis)
    if not a.size:
        return np.zeros(a.shape[axis], np.int64)
    return np.maximum(a.max(axis=other).astype(np.int64), -a.min(axis=other).astype(np.int64))


def channel_compact_rows(
    acc: np.ndarray, e: np.ndarray, axis: int, ctx: RoundCtx, key: int
) -> MX | None:
    """numerics.channel_compact of a batch-major accumulator along `axis` (not the batch axis),
    its channel maxima agreed over the data-parallel workers of ctx.rows; None if all zero.
    The shifts are numerics'; the rounding is fast_shift_right's (bit-identical)."""
    a = np.asarray(acc)
    if a.dtype.kind not in "iu" or debug_on():
        a = i64(a)
    amax = axis_abs_max(a, axis)
    if ctx.rows is not None:
        amax = ctx.rows.max(amax)
    start = row_offset(a, ctx.rows)
    if debug_on():
        out = channel_compact(a, e, ctx.bits, ctx.rounding, key, axis, amax=amax, start=start)
        return None if out is None else MX.of(out[0], out[1])
    check_int32(a, "compact")
    shifts = channel_shifts(amax, e, ctx.bits)
    if shifts is None:
        return None
    frame, right, up = shifts
    shape = [1] * a.ndim
    shape[axis] = a.shape[axis]
    # every channel's rounding fits qmax(B): no clip (numerics §5)
    rounded = fast_shift_right(
        a, right.reshape(shape), ctx.rounding, key, int(amax.max()), True, start
    )
    return MX.of(
        (rounded.astype(np.int16) << up.reshape(shape).astype(np.int16)).astype(np.int8), frame
    )


def common_shifts(e_out: int, e_grp: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """compact_common's per-group right shifts e_out - e_g, 0 for an all-zero group (amax_g = 0),
    whose shift may be negative and whose result is 0 at any shift."""
    return np.where(amax > 0, e_out - i64(e_grp), 0)


def compact_common(
    acc: np.ndarray,
    e_grp: np.ndarray,
    axis: int,
    ctx: RoundCtx,
    key: int,
    amax: np.ndarray | None = None,
    batch: bool = False,
) -> MX:
    """Compact an accumulator whose exponent differs per index along `axis` to one exponent.

    s_g = compaction_shift(max|acc_g|); e_out = max over non-zero groups of (e_g + s_g) (max e_g if
    all are zero); every group is shift_signed by e_out - e_g with one rounding (key). A group
    with a non-zero value has e_out - e_g >= s_g >= 0, so its result fits qmax; an all-zero group
    may have e_out - e_g < 0, and its exact left shift is 0, as is any shift of it: it is shifted
    by 0 here (docs/numerics.md section 5). amax: max|acc_g| per group if the caller knows it
    exactly. `batch`: acc is batch-major, its rows shared among the data-parallel workers of
    ctx.rows (amax then over all of them).
    """
    if batch and axis == 1 and channels_on(ctx):
        # the groups are the channels: each keeps its own B-bit exponent in one int8 frame
        chan = channel_compact_rows(acc, i64(e_grp), 1, ctx, key)
        if chan is not None:
            return chan
    a = np.asarray(acc)
    if a.dtype.kind not in "iu" or debug_on():
        a = i64(a)
    check_int32(a, "compact")
    eg = i64(e_grp)
    rows = ctx.rows if batch else None
    amax = i64(amax) if amax is not None else axis_abs_max(a, axis)
    if rows is not None and axis != 0:
        amax = rows.max(amax)  # the groups (channels) are every worker's: their maxima agree
    start = row_offset(a, rows)
    s = compaction_shift(amax, ctx.bits)
    cand = eg + s
    e_out = int(cand[amax > 0].max()) if np.any(amax > 0) else int(eg.max())
    if rows is not None and axis == 0:
        # the groups are this worker's rows: e_out is the largest over every worker's rows
        low = np.iinfo(np.int32).min
        mine = [e_out if np.any(amax > 0) else low, int(np.any(amax > 0)), int(eg.max())]
        best, any_nonzero, top = (int(v) for v in rows.max(np.asarray(mine, np.int64)))
        e_out = best if any_nonzero else top
    shape = [1] * a.ndim
    shape[axis] = a.shape[axis]
    sh = common_shifts(e_out, eg, amax).reshape(shape)
    q = qmax(ctx.bits)
    if not debug_on() and a.size and int(sh.max()) <= 30:
        # every group's shift is >= its compaction shift: the result fits qmax without a clip
        fast = round_shift32(a, sh, int(amax.max()), ctx.rounding, key, np.int8, start)
        if fast is not None:
            return MX.of(fast, e_out)
    out = fast_shift_right(i64(a), sh, ctx.rounding, key, start=start)
    return MX.of(np.clip(out, -q, q).astype(np.int8), e_out)


def aligned_sum_fast(
    terms: Sequence[tuple[np.ndarray, np.ndarray | int, int]],
    rounding: Rounding,
    keys: list[int],
    starts: list[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Bit-identical to numerics.aligned_sum, but skips terms whose shift is all zero.

    (shift_right by 0 returns its input exactly, so skipping it changes no bit; it saves the
    PRNG evaluation over a large tensor.) starts[i]: the PRNG index of term i's element 0 (a
    data-parallel worker's rows; 0 by default).
    """
    ndim = max(np.ndim(x) for x, _, _ in terms)
    exps = [expand_exponent(e, max(ndim, np.ndim(e))) for _, e, _ in terms]
    target = aligned_target([(x, e, b) for (x, _, b), e in zip(terms, exps)])
    total: np.ndarray | None = None
    for i, ((x, _, _), e) in enumerate(zip(terms, exps)):
        start = starts[i] if starts else 0
        aligned = align_term(x, target - e, rounding, keys[i], start)
        total = aligned if total is None else total + aligned
    assert total is not None
    check_int32(total, "aligned_sum")
    return total, target


def aligned_target(terms: Sequence[tuple[Any, np.ndarray | int, int]]) -> np.ndarray:
    """numerics.aligned_sum's target exponent of `terms` (value, exponent, bound bits): it
    depends only on the exponents and bounds, so the reference is asked on zeros."""
    ndim = max(np.ndim(x) for x, _, _ in terms)
    exps = [np.asarray(e) for _, e, _ in terms]
    dummy = np.zeros(np.broadcast_shapes((1,) * ndim, *(np.shape(e) for e in exps)), np.int64)
    _, target = aligned_sum([(dummy, e, b) for e, (_, _, b) in zip(exps, terms)], "nearest")
    return target


def align_term(
    x: np.ndarray, sh: np.ndarray | int, rounding: Rounding, key: int, start: int = 0
) -> np.ndarray:
    """One term of aligned_sum shifted to the target (sh = target - its exponent): shift_signed
    with `key` and PRNG index start + flat index, skipped where every shift is 0 (a shift by
    0 returns its input exactly)."""
    xv = i64(x)
    if not np.any(sh):
        return xv
    if np.all(np.asarray(sh) > 0):
        return fast_shift_right(xv, sh, rounding, key, start=start)
    if np.all(np.asarray(sh) <= 0):  # shift_signed is then an exact left shift
        aligned = xv << -np.asarray(sh)
        check_int32(aligned, "shift_left")
        return aligned
    return shift_signed(xv, np.broadcast_to(sh, np.shape(x)), rounding, key, start)


def fit_product(
    a: np.ndarray, e_a: int, k: int, ctx: RoundCtx | None, key: int, start: int = 0
) -> tuple[np.ndarray, int]:
    """Pre-shift operand `a` when the K-wide int8 x int8 product cap is negative.

    cap = product_cap(K, 8); if cap < 0, a <- round(a / 2^-cap) (ctx rounding with `key`, nearest
    without ctx; `start` the PRNG index of a's element 0) and its exponent grows by -cap. Then
    K * |a| * 127 < 2^31.
    """
    cap = product_cap(k, INT8_BITS)
    if cap >= 0:
        return np.asarray(a), e_a
    rounding: Rounding = ctx.rounding if ctx is not None else "nearest"
    return fast_shift_right(i64(a), -cap, rounding, key, start=start), e_a + (-cap)


def product_bits(k: int) -> int:
    """Static magnitude bits of a K-wide int8 x int8 inner product: |acc| < 2^(14 + ceil log2 K)."""
    return 2 * MAG + ceil_log2(max(k, 1))


def fast_compact_to_bits(
    x: np.ndarray,
    exponent: np.ndarray | int,
    magnitude_bits_max: int,
    rounding: Rounding,
    key: int = 0,
    rows: Rows | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """== numerics.compact_to_bits: per-tensor rounded right shift so |x| <= 2^magnitude_bits
    (`rows`: x is batch-major, its rows shared among data-parallel workers)."""
    xv = i64(x)
    m = global_abs_max(xv, rows)
    s = 0
    while m > (1 << magnitude_bits_max) << s:
        s += 1
    start = row_offset(xv, rows)
    return fast_shift_right(xv, s, rounding, key, start=start), np.asarray(exponent, np.int64) + s


F32_EXACT = 2**24  # IEEE binary32 holds every integer n with |n| <= 2^24
F64_EXACT = 2**53  # IEEE binary64: every integer n with |n| <= 2^53
INT8_CONTAINER = 128  # |v| <= 128 for every int8 value, -128 included


def int_matmul(
    a: np.ndarray, b: np.ndarray, amax: int = INT8_CONTAINER, bmax: int = INT8_CONTAINER
) -> np.ndarray:
    """Exact integer matmul (int64 result) == numerics.matmul_exact(a, b), with static bounds.

    The float paths are an exact emulation of the integer sum, not an approximation. A classical
    GEMM (numpy's BLAS: blocked, threaded, with or without FMA; no Strassen-like algorithm, which
    would add operands before multiplying) forms every intermediate of an output as a sum of some
    of its K products a[i, k] * b[k, j], in whatever order, so every intermediate is an integer
    of magnitude <= K * amax * bmax. IEEE binary32 represents every integer up to 2^24 and
    binary64 every integer up to 2^53, so below those bounds no operation rounds (an IEEE
    operation whose exact result is representable returns it) and the result is the integer sum;
    the conversions are exact as well (the operands are integers below the bound, the result is
    integer-valued). Hence: float32 when K * amax * bmax < 2^24 (int8 operands: K <= 1023),
    float64 when < 2^53 (int8 operands: K < 2^39, i.e. always in practice), else numpy's exact
    int64 matmul.

    |a| <= amax and |b| <= bmax are the caller's contract, not scanned for (a scan would cost about
    a third of the product): the defaults, 128, hold for every int8 value, so every MX mantissa
    (|m| <= 127) and every pre-shifted one (fit_product) satisfies them. In overflow_debug mode the
    contract is checked, and operands outside it take the int64 path. check_int32 on the result.
    """
    k = a.shape[-1]
    bound = amax * bmax * max(k, 1)
    if debug_on() and (_magnitude(a) > amax or _magnitude(b) > bmax):
        bound = F64_EXACT  # the static bound does not hold: exact integer arithmetic
    if bound < F32_EXACT:
        out = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.int64)
    elif bound < F64_EXACT:
        out = np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.int64)
    else:
        out = np.matmul(i64(a), i64(b))
    check_int32(out, "product")
    return out


def _magnitude(x: np.ndarray) -> int:
    """max |x| (0 for an empty array), exact in int64."""
    xv = i64(x)
    return int(max(xv.max(), -xv.min())) if xv.size else 0


# ------------------------------------------------------------------------------ blocked fast paths
# The same arithmetic as fast_element_bits / round_shift32, processed in blocks of rows along
# axis 0 so the PRNG words and the temporaries stay in cache (a large speedup on big tensors).

BLOCK_ELEMS = 1 << 15
_BASE_BITS: list[np.ndarray] = []


def _golden_base(n: int) -> np.ndarray:
    """index * GOLDEN32 (mod 2^32) for index 0..n-1 (cached, grown on demand)."""
    if not _BASE_BITS or _BASE_BITS[0].size < n:
        with np.errstate(over="ignore"):
            g = np.arange(max(n, BLOCK_ELEMS), dtype=_U32) * _U32(GOLDEN32)
        _BASE_BITS[:] = [g]
    return _BASE_BITS[0][:n]


def element_bits_into(v: np.ndarray, tmp: np.ndarray, key: int, start: int) -> np.ndarray:
    """Write fast_element_bits(key, .) of the flat indices start .. start + v.size - 1 into the
    contiguous uint32 array v (tmp: scratch uint32 of the same size). Returns v."""
    n = v.size
    vf = v.reshape(-1)
    t = tmp.reshape(-1)[:n]
    with np.errstate(over="ignore"):
        np.add(_golden_base(n), _U32((start * GOLDEN32) & 0xFFFFFFFF), out=vf)
    vf ^= _U32(key & 0xFFFFFFFF)
    _mix32_inplace(vf, t)
    return v


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows (along axis 0) per block of about BLOCK_ELEMS elements."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMS // max(row, 1))


class RoundBlocks:
    """Per-block rounding offsets r of numerics.shift_right with a shift s that broadcasts
    against blocks of rows (s has leading dimension 1 or fewer dimensions than the data).

    offsets(i0, b) fills the int32 block b (rows i0 .. i0 + len(b) - 1 of a tensor whose row has
    `row` elements) with r = bits & (2^s - 1) (stochastic) or 2^(s-1) (nearest)."""

    def __init__(self, s: np.ndarray | int, rounding: Rounding, key: int, row: int) -> None:
        s32 = np.asarray(s, dtype=np.int64).astype(np.int32)
        self.mask = (np.int32(1) << s32) - np.int32(1)
        self.half = (np.int32(1) << s32) >> np.int32(1)
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"unknown rounding {rounding!r}")
        self.stochastic = rounding == "stochastic"
        self.key = key
        self.row = row
        self._tmp: np.ndarray | None = None

    def offsets(self, i0: int, b: np.ndarray) -> np.ndarray:
        if self.stochastic:
            if self._tmp is None or self._tmp.size < b.size:
                self._tmp = np.empty(b.size, _U32)
            element_bits_into(b.view(_U32), self._tmp, self.key, i0 * self.row)
            b &= self.mask
        else:
            b[...] = self.half
        return b


def round_shift_blocked(
    x: np.ndarray,
    s: np.ndarray | int,
    amax: int,
    rounding: Rounding,
    key: int,
    out_dtype: type = np.int32,
) -> np.ndarray | None:
    """== round_shift32(x, s, amax, rounding, key, out_dtype) (None in the same cases), computed
    in blocks of rows. s must broadcast against x with a leading dimension of 1 (or fewer dims)."""
    sv = np.asarray(s, dtype=np.int64)
    if sv.size == 0 or x.size == 0 or x.ndim == 0:
        return None
    smin, smax = int(sv.min()), int(sv.max())
    if smin < 0 or smax > 30 or amax + (1 << smax) - 1 >= 2**31:
        return None
    if sv.ndim > x.ndim or (sv.ndim == x.ndim and sv.shape[0] != 1):
        return round_shift32(x, s, amax, rounding, key, out_dtype)
    s32 = sv.astype(np.int32)
    n = x.shape[0]
    rows = block_rows(x.shape)
    row = x.size // n
    rb = RoundBlocks(sv, rounding, key, row)
    out: np.ndarray = np.empty(x.shape, out_dtype)
    buf = np.empty((min(rows, n),) + x.shape[1:], np.int32)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        b = rb.offsets(i0, buf[: i1 - i0])
        b += x[i0:i1]
        b >>= s32
        out[i0:i1] = b
    return out
