"""Reference integer primitives: the executable form of docs/numerics.md.

Every function here is exact integer arithmetic on numpy arrays. Backends (TVM CPU, C for MCUs,
CUDA) must reproduce these results bit for bit. Internally the reference computes in int64 where
that is the simplest way to state the exact result; the spec proves the int32 (and uint32) forms
used by backends give the same numbers.

Conventions
- A mantissa is an int8 array holding a B-bit signed value in [-qmax(B), qmax(B)].
- An exponent array broadcasts against its mantissa: shape () for one exponent per tensor, shape
  (G,) for one exponent per group along axis 0 (see `expand_exponent`).
- Rounding is "stochastic" (training) or "nearest" (inference, round half up).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Rounding = Literal["stochastic", "nearest"]
ROUNDINGS: tuple[Rounding, ...] = ("stochastic", "nearest")
# How a training program rounds (docs/numerics.md §4, "Rounding modes of a program"): every site
# alike, or the forward nodes to nearest and the backward pass and updates stochastically.
# "auto" picks nearest-forward below 8 bits and stochastic at 8.
NEAREST_FORWARD = "nearest-forward"
ROUNDING_MODES: tuple[str, ...] = ("stochastic", "nearest", NEAREST_FORWARD)


def rounding_mode_for(mode: str, bits: int) -> str:
    """The program-level rounding mode that `mode` ("auto" or one of ROUNDING_MODES) means."""
    if mode == "auto":
        return NEAREST_FORWARD if bits < 8 else "stochastic"
    if mode not in ROUNDING_MODES:
        raise ValueError(f"rounding must be 'auto' or one of {ROUNDING_MODES}, got {mode!r}")
    return mode


def channel_exponents_for(choice: bool | None, bits: int) -> bool:
    """Whether a program rounds per channel (§5, "Channel exponents"): `choice`, or by default
    (None) below 8 bits, where one exponent per tensor rounds whole channels to 0 (B = 4 does not
    train without them: docs/benchmarks.md, "Low bit widths"). A no-op at 8 bits."""
    return bits < CONTAINER_BITS if choice is None else bool(choice)


def site_rounding(mode: str, forward: bool) -> Rounding:
    """The rounding of a node's sites under program mode `mode`; `forward`: the node belongs to
    the forward graph (its rid is below the graph's `forward_rids`)."""
    if mode == NEAREST_FORWARD:
        return "nearest" if forward else "stochastic"
    return "nearest" if mode == "nearest" else "stochastic"


INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
GOLDEN32 = 0x9E3779B9
_U32 = np.uint32


class OverflowDebugError(ArithmeticError):
    """An int32 intermediate left the int32 range while overflow debugging was on."""


_DEBUG_OVERFLOW = False


def set_overflow_debug(enabled: bool) -> bool:
    """Turn the int32 overflow checks on or off; returns the previous setting."""
    global _DEBUG_OVERFLOW
    previous = _DEBUG_OVERFLOW
    _DEBUG_OVERFLOW = enabled
    return previous


def overflow_debug_on() -> bool:
    """Whether the int32 overflow checks are on."""
    return _DEBUG_OVERFLOW


class overflow_debug:
    """Context manager: check every int32 intermediate of every primitive for overflow."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._previous = False

    def __enter__(self) -> overflow_debug:
        self._previous = set_overflow_debug(self.enabled)
        return self

    def __exit__(self, *exc: object) -> None:
        set_overflow_debug(self._previous)


def check_int32(x: np.ndarray | int, primitive: str) -> None:
    """In debug mode, raise if any value of `x` (computed exactly, in int64) is outside int32."""
    if not _DEBUG_OVERFLOW:
        return
    arr = np.asarray(x)
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < INT32_MIN or hi > INT32_MAX:
        raise OverflowDebugError(
            f"int32 overflow in primitive '{primitive}': intermediate range [{lo}, {hi}] "
            f"exceeds [{INT32_MIN}, {INT32_MAX}]. The static shift caps should have prevented "
            "this; tile the reduction or pre-shift its operands (docs/numerics.md, 'Caps')."
        )


# --------------------------------------------------------------------------- mantissa range


def qmax(bits: int) -> int:
    """Largest mantissa magnitude of a B-bit symmetric mantissa: 2^(B-1) - 1."""
    if not 2 <= bits <= 8:
        raise ValueError(f"mantissa bits must be in 2..8, got {bits}")
    return (1 << (bits - 1)) - 1


def saturate(x: np.ndarray, bits: int) -> np.ndarray:
    """Clamp to [-qmax, qmax] and return int8."""
    q = qmax(bits)
    return np.clip(np.asarray(x, dtype=np.int64), -q, q).astype(np.int8)


def expand_exponent(e: np.ndarray | int, ndim: int) -> np.ndarray:
    """Shape an exponent for broadcasting: () stays (), (G,) becomes (G, 1, ..., 1)."""
    arr = np.asarray(e, dtype=np.int64)
    if arr.ndim == 0:
        return arr
    return arr.reshape(arr.shape + (1,) * (ndim - arr.ndim))


# --------------------------------------------------------------------------- PRNG


def mix32(x: np.ndarray | int) -> np.ndarray:
    """lowbias32 (C. Wellons): a bijective uint32 -> uint32 hash, wrapping mod 2^32."""
    v = np.asarray(x).astype(_U32, copy=True)
    with np.errstate(over="ignore"):
        v ^= v >> _U32(16)
        v *= _U32(0x7FEB352D)
        v ^= v >> _U32(15)
        v *= _U32(0x846CA68B)
        v ^= v >> _U32(16)
    return v


def _step_key(seed: int, step: int) -> int:
    """mix32(mix32(seed) ^ step): the part of a stream key shared by a step's tensors."""
    return int(mix32(int(mix32(seed & 0xFFFFFFFF)) ^ (step & 0xFFFFFFFF)))


def stream_key(seed: int, step: int, tensor_id: int) -> int:
    """Per (seed, step, tensor) key: mix32(mix32(mix32(seed) ^ step) ^ tensor_id)."""
    return int(mix32(_step_key(seed, step) ^ (tensor_id & 0xFFFFFFFF)))


def stream_keys(seed: int, step: int, tensor_ids: np.ndarray) -> np.ndarray:
    """stream_key for many tensor ids at once (uint32 values in an int64 array)."""
    ids = np.asarray(tensor_ids, np.int64) & 0xFFFFFFFF
    return mix32(ids.astype(np.uint32) ^ np.uint32(_step_key(seed, step))).astype(np.int64)


def random_bits(key: int, index: np.ndarray) -> np.ndarray:
    """uint32 random word of element `index`: mix32(key ^ (index * 0x9E3779B9 mod 2^32))."""
    idx = np.asarray(index).astype(_U32)
    with np.errstate(over="ignore"):
        return mix32(_U32(key & 0xFFFFFFFF) ^ (idx * _U32(GOLDEN32)))


def element_bits(key: int, shape: tuple[int, ...], start: int = 0) -> np.ndarray:
    """Random words for every element of a C-ordered tensor of `shape` (index = flat position
    plus `start`: a data-parallel worker's share of a batch-major tensor starts at its first
    global element, section 16)."""
    n = int(np.prod(shape, dtype=np.int64))
    idx = (np.arange(n, dtype=np.int64) + start) & 0xFFFFFFFF
    return random_bits(key, idx.astype(np.uint32)).reshape(shape)


# --------------------------------------------------------------------------- shifts


def shift_right(
    x: np.ndarray,
    s: np.ndarray | int,
    rounding: Rounding,
    key: int = 0,
    start: int = 0,
) -> np.ndarray:
    """Right shift of int32 values by s >= 0 with rounding; returns int64 holding int32 values.
    `start`: the PRNG index of element 0 (element_bits).

    stochastic: floor((x + r) / 2^s) with r = bits(key, i) & (2^s - 1), in the split form
                (x >> s) + (((x & (2^s-1)) + r) >> s) whose inner sum is a uint32 < 2^32.
    nearest:    same with r = 2^(s-1) (round half up); s = 0 returns x.
    s >= 32 gives 0 (the exact value is below half a unit).
    """
    xv = np.asarray(x, dtype=np.int64)
    sv = np.broadcast_to(np.asarray(s, dtype=np.int64), xv.shape)
    if np.any(sv < 0):
        raise ValueError("shift_right needs s >= 0")
    check_int32(xv, "shift_right")
    small = np.minimum(sv, 31)
    mask = (np.int64(1) << small) - 1
    if rounding == "stochastic":
        r = element_bits(key, xv.shape, start).astype(np.int64) & mask
    elif rounding == "nearest":
        r = np.where(small > 0, np.int64(1) << np.maximum(small - 1, 0), 0)
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    out = (xv >> small) + (((xv & mask) + r) >> small)
    return np.where(sv >= 32, 0, out)


def shift_left(x: np.ndarray, s: np.ndarray | int, primitive: str = "shift_left") -> np.ndarray:
    """Exact left shift by s >= 0 (int64 result; debug mode checks it fits int32)."""
    xv = np.asarray(x, dtype=np.int64)
    sv = np.asarray(s, dtype=np.int64)
    if np.any(sv < 0):
        raise ValueError("shift_left needs s >= 0")
    out = xv << sv
    check_int32(out, primitive)
    return out


def shift_signed(
    x: np.ndarray, s: np.ndarray | int, rounding: Rounding, key: int = 0, start: int = 0
) -> np.ndarray:
    """Multiply by 2^-s: right shift with rounding where s > 0, exact left shift where s < 0."""
    sv = np.broadcast_to(np.asarray(s, dtype=np.int64), np.shape(x))
    right = shift_right(x, np.maximum(sv, 0), rounding, key, start)
    return np.where(sv < 0, shift_left(x, np.maximum(-sv, 0)), right)


def shift_left_saturating(x: np.ndarray, s: np.ndarray | int, limit_bits: int = 30) -> np.ndarray:
    """Left shift by s >= 0, clamped to +-2^limit_bits (used only to align updates)."""
    xv = np.asarray(x, dtype=np.int64)
    sv = np.minimum(np.asarray(s, dtype=np.int64), 62 - 8)
    lim = np.int64(1) << limit_bits
    return np.clip(xv << sv, -lim, lim)


# --------------------------------------------------------------------------- caps


def ceil_log2(n: int) -> int:
    """Smallest c with 2^c >= n (n >= 1)."""
    if n < 1:
        raise ValueError("ceil_log2 needs n >= 1")
    return (n - 1).bit_length()


def product_cap(k: int, bits: int, bits_b: int | None = None) -> int:
    """int32 headroom of a K-wide inner product: 31 - ((Ba-1) + (Bb-1) + ceil(log2 K))."""
    bb = bits if bits_b is None else bits_b
    return 31 - ((bits - 1) + (bb - 1) + ceil_log2(k))


def sum_cap(m: int, bits: int) -> int:
    """int32 headroom of an M-way sum of B-bit mantissas: 31 - ((B-1) + ceil(log2 M))."""
    return 31 - ((bits - 1) + ceil_log2(m))


def magnitude_bits(max_abs: int) -> int:
    """Smallest b with max_abs < 2^b."""
    return int(max_abs).bit_length()


# --------------------------------------------------------------------------- compaction


def compaction_shift(max_abs: np.ndarray | int, bits: int) -> np.ndarray:
    """Smallest s >= 0 with ceil(max_abs / 2^s) <= qmax(bits).

    Any rounding (stochastic or nearest) of v / 2^s with |v| <= max_abs then lies in [-qmax, qmax].
    """
    m = np.asarray(max_abs, dtype=np.int64)
    q = qmax(bits)
    s = np.zeros(m.shape, dtype=np.int64)
    # ceil(m / 2^s) <= q  <=>  m <= q * 2^s
    need = m > q
    while np.any(need):
        s = np.where(need, s + 1, s)
        need = m > (np.int64(q) << s)
    return s


def group_max_abs(x: np.ndarray, grouped: bool) -> np.ndarray:
    """max |x| over the whole tensor (shape ()) or per group along axis 0 (shape (G,))."""
    a = np.abs(np.asarray(x, dtype=np.int64))
    if not grouped:
        return np.asarray(a.max() if a.size else 0, dtype=np.int64)
    return a.reshape(a.shape[0], -1).max(axis=1) if a.size else np.zeros(a.shape[0], np.int64)


def compact(
    acc: np.ndarray,
    exponent: np.ndarray | int,
    bits: int,
    rounding: Rounding,
    key: int = 0,
    grouped: bool = False,
    max_shift: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """int32 accumulator (value acc * 2^exponent) -> B-bit mantissa and new exponent.

    The shift is the smallest that fits the max |acc| of the tensor (or of each group along axis 0
    when `grouped`); `max_shift` is the static bound from the caps, which the dynamic shift never
    exceeds (checked). Returns (int8 mantissa, exponent + shift).
    """
    a = np.asarray(acc, dtype=np.int64)
    check_int32(a, "compact")
    s = compaction_shift(group_max_abs(a, grouped), bits)
    if max_shift is not None and np.any(s > max_shift):
        raise OverflowDebugError(
            f"compaction shift {int(s.max())} exceeds the static cap {max_shift}"
        )
    shifted = shift_right(a, expand_exponent(s, a.ndim), rounding, key)
    return saturate(shifted, bits), np.asarray(exponent, dtype=np.int64) + s


CONTAINER_BITS = 8  # every mantissa is stored in an int8


def natural_shift(max_abs: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    """compaction_shift (>= 0); with `signed`, also negative: -s for the largest s with
    max_abs * 2^s <= qmax (reactive_rescale's exact left shift). 0 where max_abs is 0."""
    s = compaction_shift(max_abs, bits)
    if not signed:
        return s
    m = np.asarray(max_abs, dtype=np.int64)
    q = np.int64(qmax(bits))
    grow = (m > 0) & (s == 0)  # fits qmax: grow while twice the value still fits
    while np.any(more := grow & ((m << np.maximum(1 - s, 0)) <= q)):
        s = np.where(more, s - 1, s)
    return s


def channel_frame(x: np.ndarray, live: np.ndarray, bits: int) -> tuple[int, np.ndarray]:
    """The int8 frame F = max(x_c over live channels) - (8 - B) of channels whose B-bit
    exponents are x, and each channel's exponent t_c = max(x_c, F) (section 5)."""
    frame = int(np.asarray(x)[live].max()) - (CONTAINER_BITS - bits)
    return frame, np.maximum(x, frame)


def channel_shifts(
    amax: np.ndarray, exponent: np.ndarray | int, bits: int, signed: bool = False
) -> tuple[int, np.ndarray, np.ndarray] | None:
    """channel_compact's shifts from the channel maxima: (F, t_c - e_c, t_c - F), both 0 for an
    all-zero channel (which is 0 at any shift); None when every channel is zero."""
    live = amax > 0
    if not np.any(live):
        return None
    e_c = np.broadcast_to(np.asarray(exponent, dtype=np.int64), amax.shape)
    frame, t = channel_frame(e_c + natural_shift(amax, bits, signed), live, bits)
    return frame, np.where(live, t - e_c, 0), np.where(live, t - frame, 0)


def channel_compact(
    acc: np.ndarray,
    exponent: np.ndarray | int,
    bits: int,
    rounding: Rounding,
    key: int,
    axis: int,
    signed: bool = False,
    amax: np.ndarray | None = None,
    start: int = 0,
) -> tuple[np.ndarray, int] | None:
    """Compaction with channel exponents (docs/numerics.md section 5, "Channel exponents").

    Each index c along `axis` (a channel) is rounded to B bits at its own exponent
    t_c = max(x_c, F), x_c = e_c + natural_shift(max|acc_c|), F = max(x_c) - (8 - B), and stored
    as an int8 in the tensor's frame F: m = saturate(round(acc_c / 2^(t_c - e_c)), B) << (t_c - F),
    so |m| <= qmax(B) 2^(8-B) <= 127. `exponent`: scalar or one per channel (e_c). `amax`: the
    channel maxima when the caller knows them (data-parallel workers agree on them).
    Returns (int8 mantissa, F), or None when every channel is zero (the caller's plain rule
    applies).
    """
    a = np.asarray(acc, dtype=np.int64)
    check_int32(a, "compact")
    other = tuple(i for i in range(a.ndim) if i != axis)
    if amax is None:
        amax = np.abs(a).max(axis=other) if a.size else np.zeros(a.shape[axis], np.int64)
    shifts = channel_shifts(np.asarray(amax, dtype=np.int64), exponent, bits, signed)
    if shifts is None:
        return None
    frame, right, up = shifts
    shape = [1] * a.ndim
    shape[axis] = a.shape[axis]
    rounded = saturate(shift_signed(a, right.reshape(shape), rounding, key, start), bits)
    return (rounded.astype(np.int64) << up.reshape(shape)).astype(np.int8), frame


# --------------------------------------------------------------------------- products


def matmul_exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact integer matmul of small-integer operands (int64 result).

    Uses float64 BLAS when every partial sum is provably exact (|a|max*|b|max*K < 2^53), else
    int64 numpy. Either way the result equals the int32 accumulation of the spec.
    """
    a64 = np.asarray(a, dtype=np.int64)
    b64 = np.asarray(b, dtype=np.int64)
    k = a64.shape[-1]
    amax = int(np.abs(a64).max()) if a64.size else 0
    bmax = int(np.abs(b64).max()) if b64.size else 0
    if amax * bmax * max(k, 1) < 2**53:
        out = np.matmul(a64.astype(np.float64), b64.astype(np.float64)).astype(np.int64)
    else:
        out = np.matmul(a64, b64)
    check_int32(out, "product")
    return out


# --------------------------------------------------------------------------- sums


def aligned_sum(
    terms: list[tuple[np.ndarray, np.ndarray | int, int]],
    rounding: Rounding,
    keys: list[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sum of M terms x_i * 2^e_i, where |x_i| < 2^b_i is known statically.

    Target exponent e = max(min_i e_i, max_i(e_i + b_i) + c - 31) with c = floor(log2 M) + 1 for
    M >= 2 and c = 0 for M = 1: the smallest exponent at which the M aligned terms cannot overflow
    int32. (c = ceil(log2 M) is not enough when M is a power of two: a right-shifted term may round
    up to exactly 2^(31-c), and M such terms sum to 2^31.) Terms with e_i >= e are left-shifted
    exactly, terms with e_i < e are right-shifted by (e - e_i) with rounding (key i). Exponents may
    be arrays that broadcast against the mantissas (per-group sums). Returns (int64 acc holding
    int32, e).
    """
    if not terms:
        raise ValueError("aligned_sum needs at least one term")
    m = len(terms)
    ndim = max(np.ndim(x) for x, _, _ in terms)
    exps = [expand_exponent(e, max(ndim, np.ndim(e))) for _, e, _ in terms]
    e_min = exps[0]
    e_top = exps[0] + terms[0][2]
    for (_, _, b), e in zip(terms[1:], exps[1:]):
        e_min = np.minimum(e_min, e)
        e_top = np.maximum(e_top, e + b)
    c = m.bit_length() if m > 1 else 0
    target = np.maximum(e_min, e_top + c - 31)
    total: np.ndarray | None = None
    for i, ((x, _, _), e) in enumerate(zip(terms, exps)):
        key = keys[i] if keys else 0
        aligned = shift_signed(
            np.asarray(x, np.int64), np.broadcast_to(target - e, np.shape(x)), rounding, key
        )
        total = aligned if total is None else total + aligned
    assert total is not None
    check_int32(total, "aligned_sum")
    return total, target


# --------------------------------------------------------------------------- divide by constant


@dataclass(frozen=True)
class Reciprocal:
    """Precomputed reciprocal of an integer divisor d = 2^k * o (o odd), for |x| < 2^15.

    round(x / o) = sign(x) * (((|x| + (o-1)/2) * mult) >> shift), exact for |x| <= 2^15,
    with shift = 16 + L, L = ceil(log2 o), mult = ceil(2^shift / o).
    """

    divisor: int
    pow2: int
    odd: int
    mult: int
    shift: int

    @staticmethod
    def of(divisor: int) -> Reciprocal:
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        k = (divisor & -divisor).bit_length() - 1
        odd = divisor >> k
        shift = 16 + ceil_log2(odd)
        mult = -((-(1 << shift)) // odd)
        return Reciprocal(divisor, k, odd, mult, shift)


DIV_INPUT_LIMIT = 1 << 15


def div_const(
    x: np.ndarray, exponent: np.ndarray | int, recip: Reciprocal
) -> tuple[np.ndarray, np.ndarray]:
    """(x * 2^exponent) / d -> (round(x / odd), exponent - pow2). Needs |x| <= 2^15.

    The odd part is divided by multiply-and-shift, giving the exact round-to-nearest quotient
    (odd divisors have no ties).
    """
    xv = np.asarray(x, dtype=np.int64)
    if xv.size and int(np.abs(xv).max()) > DIV_INPUT_LIMIT:
        raise ValueError(
            f"div_const input exceeds 2^15 (max |x| = {int(np.abs(xv).max())}); "
            "compact to 16 bits first"
        )
    n = np.abs(xv) + (recip.odd - 1) // 2
    q = (n * recip.mult) >> recip.shift
    return np.sign(xv) * q, np.asarray(exponent, dtype=np.int64) - recip.pow2


def compact_to_bits(
    x: np.ndarray,
    exponent: np.ndarray | int,
    magnitude_bits_max: int,
    rounding: Rounding,
    key: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Right-shift (with rounding) so |x| <= 2^magnitude_bits_max; per tensor. Returns (x, e)."""
    xv = np.asarray(x, dtype=np.int64)
    m = int(np.abs(xv).max()) if xv.size else 0
    s = 0
    while m > (1 << magnitude_bits_max) << s:
        s += 1
    # after rounding the max may reach ceil(m/2^s) <= 2^bits
    return shift_right(xv, s, rounding, key), np.asarray(exponent, np.int64) + s


# --------------------------------------------------------------------------- lookup tables


@dataclass(frozen=True)
class LookupTable:
    """f sampled at int8 inputs: value[i] = round(f((i - 128) * 2^in_exp) / 2^out_exp).

    Built once on the host (float allowed there); evaluated by index only.
    """

    name: str
    in_exp: int
    out_exp: int
    values: np.ndarray  # int32, 256 entries for inputs -128..127
    lo: int
    hi: int
    # a positive x reads an index of at least 1 (one rounded to 0 reads entry 1): the tables of
    # a function with a kink at 0 (relu + offset) then never mix the two sides' values
    sign_exact: bool = False

    @staticmethod
    def build(
        name: str,
        fn: object,
        in_exp: int,
        out_exp: int,
        lo: int,
        hi: int,
        sign_exact: bool = False,
    ) -> LookupTable:
        xs = np.arange(-128, 128, dtype=np.float64) * (2.0**in_exp)
        ys = np.asarray([fn(float(v)) for v in xs], dtype=np.float64)  # type: ignore[operator]
        raw = np.floor(ys / 2.0**out_exp + 0.5).astype(np.int64)
        values = np.clip(raw, lo, hi).astype(np.int32)
        return LookupTable(name, in_exp, out_exp, values, lo, hi, sign_exact)

    def lookup(
        self,
        x: np.ndarray,
        exponent: int,
        rounding: Rounding,
        key: int = 0,
        start: int = 0,
        flush: bool = False,
    ) -> np.ndarray:
        """Shift x * 2^exponent to the table's exponent, clamp to [-128, 127] (and to at least
        1 for a positive x when sign_exact), look up. `flush`: 0 where the shifted index is
        below -128 (the softmax head's exp: no mass beyond the table's range)."""
        raw = shift_signed_saturating(x, self.in_exp - exponent, rounding, key, start)
        idx = np.clip(raw, -128, 127)
        if self.sign_exact:
            idx = np.where(np.asarray(x) > 0, np.maximum(idx, 1), idx)
        values = self.values[idx + 128].astype(np.int64)
        return np.where(raw < -128, 0, values) if flush else values


def shift_signed_saturating(
    x: np.ndarray, s: int, rounding: Rounding, key: int = 0, start: int = 0
) -> np.ndarray:
    """shift_signed whose left shift saturates at +-2^30 instead of overflowing."""
    xv = np.asarray(x, np.int64)
    if s >= 0:
        return shift_right(xv, s, rounding, key, start)
    return shift_left_saturating(xv, -s)


def gelu_float(v: float) -> float:
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def gelu_grad_float(v: float) -> float:
    pdf = math.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi)
    return 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) + v * pdf


def gelu_phi_float(v: float) -> float:
    """The standard normal CDF: GELU(x) = x Phi(x)."""
    return 0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))


# GELU as x times Phi(x), as SiLU is x times sigmoid(x): the product keeps x's own precision
# at every scale (a table of GELU's values at a fixed 2^-5 step rounded small inputs to a few
# units: docs/numerics.md section 9). Phi on [-4, 4) at 1/32, values at 2^-15; past the range
# the clamped index gives Phi(3.97) = 1 - 3.6e-5 and Phi(-4) = 3.2e-5. The derivative
# Phi(x) + x phi(x), in [-0.13, 1.13], at 2^-14.
GELU_IN_EXP = -5
GELU_PHI_TABLE = LookupTable.build("gelu_phi", gelu_phi_float, GELU_IN_EXP, -15, 0, 1 << 15)
GELU_GRAD_TABLE = LookupTable.build(
    "gelu_grad", gelu_grad_float, GELU_IN_EXP, -14, -(1 << 15), 1 << 15
)
# the logistic function and SiLU (x sigmoid(x)) on [-8, 8) at 1/16, values at 2^-15 (sigmoid)
# and 2^-14 (SiLU's derivative, in [-0.1, 1.1]); past the range the clamped index gives
# sigmoid(+-7.94) and the derivatives' asymptotes within 0.003
SIGMOID_IN_EXP = -4
SIGMOID_TABLE = LookupTable.build(
    "sigmoid", lambda v: 1.0 / (1.0 + math.exp(-v)), SIGMOID_IN_EXP, -15, 0, 1 << 15
)
SIGMOID_GRAD_TABLE = LookupTable.build(
    "sigmoid_grad",
    lambda v: math.exp(-abs(v)) / (1.0 + math.exp(-abs(v))) ** 2,
    SIGMOID_IN_EXP,
    -15,
    0,
    1 << 13,
)
SILU_GRAD_TABLE = LookupTable.build(
    "silu_grad",
    lambda v: (1.0 / (1.0 + math.exp(-v))) * (1.0 + v * (1.0 - 1.0 / (1.0 + math.exp(-v)))),
    SIGMOID_IN_EXP,
    -14,
    -(1 << 15),
    1 << 15,
)
# tanh on [-4, 4) at 1/32 (past it the clamped index gives tanh(+-3.97), within 7e-4 of +-1),
# its derivative 1 - tanh^2 there; values at 2^-15
TANH_IN_EXP = -5
TANH_TABLE = LookupTable.build("tanh", math.tanh, TANH_IN_EXP, -15, -(1 << 15), 1 << 15)
TANH_GRAD_TABLE = LookupTable.build(
    "tanh_grad", lambda v: 1.0 - math.tanh(v) ** 2, TANH_IN_EXP, -15, 0, 1 << 15
)


def _softplus(v: float) -> float:
    return max(v, 0.0) + math.log1p(math.exp(-abs(v)))


def _mish_factor(v: float) -> float:
    return math.tanh(_softplus(v))


def _mish_grad(v: float) -> float:
    """d/dx x tanh(softplus(x)) = m + x (1 - m^2) sigmoid(x), m = tanh(softplus(x))."""
    m = _mish_factor(v)
    return m + v * (1.0 - m * m) / (1.0 + math.exp(-v))


# Mish (x tanh(softplus(x))) as SiLU is: x times a table of x on [-8, 8) at 1/16, the factor at
# 2^-15, the derivative (in [-0.12, 1.09]) at 2^-14
MISH_TABLE = LookupTable.build("mish", _mish_factor, SIGMOID_IN_EXP, -15, 0, 1 << 15)
MISH_GRAD_TABLE = LookupTable.build(
    "mish_grad", _mish_grad, SIGMOID_IN_EXP, -14, -(1 << 15), 1 << 15
)
EXP_IN_EXP = -4  # exp(x) for x in [-8, 0]; positive indices are never used (x <= 0)
EXP_OUT_EXP = -15
EXP_TABLE = LookupTable.build(
    "exp", lambda v: math.exp(min(v, 0.0)), EXP_IN_EXP, EXP_OUT_EXP, 0, 1 << 15
)


# The exponential-family activations as relu(x) + offset(x): the offset is a table that tends to
# a constant on both sides (0 for x >> 0; -alpha or 0 for x << 0), so the clamped index stays
# right past the table's range, where a factor table (x times table(x), as SiLU) would not.
# The derivative of relu(x) + offset(x) is relu's [x > 0] plus the offset's table, which tends
# to 0 on both sides. ELU, CELU, SELU (= lambda ELU) and Softplus (docs/layers.md).
OFFSET_FUNCTIONS = ("elu", "celu", "softplus")
OFFSET_PARAM_RANGE = (2.0**-8, 2.0**8)  # alpha and beta mexc accepts


def _offset_pair(fn: str, params: tuple[float, ...]) -> tuple[object, object, float]:
    """(offset, derivative of the offset, x scale) for f = relu + offset, as torch defines f."""
    if fn == "elu":
        (a,) = params
        return (
            lambda v: 0.0 if v > 0 else a * math.expm1(v),
            lambda v: 0.0 if v > 0 else a * math.exp(v),
            1.0,
        )
    if fn == "celu":
        (a,) = params
        return (
            lambda v: 0.0 if v > 0 else a * math.expm1(v / a),
            lambda v: 0.0 if v > 0 else math.exp(v / a),
            a,
        )
    if fn == "softplus":
        beta, threshold = params

        def offset(v: float) -> float:
            if beta * v > threshold:
                return 0.0
            return math.log1p(math.exp(-abs(beta * v))) / beta

        def derivative(v: float) -> float:
            relu_grad = 1.0 if v > 0 else 0.0
            if beta * v > threshold:
                return 1.0 - relu_grad
            return 1.0 / (1.0 + math.exp(-beta * v)) - relu_grad

        return offset, derivative, 1.0 / beta
    raise ValueError(f"no offset table for {fn!r}; known: {', '.join(OFFSET_FUNCTIONS)}")


def _table_for(name: str, fn: object, in_exp: int) -> LookupTable:
    """fn sampled at 256 points of 2^in_exp, at the finest exponent that keeps every value
    within +-2^15; sign-exact, so that relu's [x > 0] and the offset's table agree on the
    side of 0 (an index rounded to 0 from a positive x would read the negative side's
    derivative, doubling ELU's)."""
    xs = np.arange(-128, 128, dtype=np.float64) * (2.0**in_exp)
    peak = max(abs(float(fn(float(v)))) for v in xs)  # type: ignore[operator]
    out_exp = (math.ceil(math.log2(peak)) if peak > 0 else 0) - 15
    return LookupTable.build(name, fn, in_exp, out_exp, -(1 << 15), 1 << 15, sign_exact=True)


def offset_tables(fn: str, params: tuple[float, ...]) -> tuple[LookupTable, LookupTable]:
    """The offset's table and its derivative's for relu(x) + offset(x), built on the host: the
    index covers [-8 s, 8 s) at s / 16 (s the function's x scale rounded up to a power of two:
    1, alpha for CELU, 1 / beta for Softplus), where every offset is within 3.4e-4 (relative
    to alpha, or 1 / beta) of its limit. Equal (fn, params) give equal tables, and the name
    (a C identifier) says both."""
    key = (fn, tuple(float(p) for p in params))
    if key not in _OFFSET_CACHE:
        offset, derivative, scale = _offset_pair(fn, key[1])
        in_exp = SIGMOID_IN_EXP + math.ceil(math.log2(scale))
        tag = "_".join(repr(p).replace(".", "p").replace("-", "m").replace("+", "") for p in key[1])
        _OFFSET_CACHE[key] = (
            _table_for(f"{fn}_{tag}", offset, in_exp),
            _table_for(f"{fn}_{tag}_grad", derivative, in_exp),
        )
    return _OFFSET_CACHE[key]


_OFFSET_CACHE: dict[tuple[str, tuple[float, ...]], tuple[LookupTable, LookupTable]] = {}


# --------------------------------------------------------------------------- sqrt and division


def isqrt(n: np.ndarray) -> np.ndarray:
    """floor(sqrt(n)) for 0 <= n < 2^62, exact (float estimate, then integer correction)."""
    nv = np.asarray(n, dtype=np.int64)
    if np.any(nv < 0):
        raise ValueError("isqrt needs n >= 0")
    r = np.floor(np.sqrt(nv.astype(np.float64))).astype(np.int64)
    r = np.where(r * r > nv, r - 1, r)
    r = np.where(r * r > nv, r - 1, r)
    r = np.where((r + 1) * (r + 1) <= nv, r + 1, r)
    return np.where((r + 1) * (r + 1) <= nv, r + 1, r)


def idiv_round(a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    """round(a / b) for b > 0, ties away from zero: sign(a) * floor((|a| + floor(b/2)) / b)."""
    av = np.asarray(a, dtype=np.int64)
    bv = np.asarray(b, dtype=np.int64)
    if np.any(bv <= 0):
        raise ValueError("idiv_round needs b > 0")
    return np.sign(av) * ((np.abs(av) + bv // 2) // bv)


def idiv_floor(a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    """floor(a / b) for b > 0."""
    bv = np.asarray(b, dtype=np.int64)
    if np.any(bv <= 0):
        raise ValueError("idiv_floor needs b > 0")
    return np.asarray(a, dtype=np.int64) // bv


# --------------------------------------------------------------------------- scalars as num/shift


@dataclass(frozen=True)
class FixedScalar:
    """A positive host-side scalar as numerator * 2^-shift with a 15-bit numerator."""

    num: int
    shift: int

    @staticmethod
    @functools.lru_cache(maxsize=4096, typed=True)  # a C learning-rate table: 65,536 steps
    def of(value: float, num_bits: int = 15) -> FixedScalar:
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"scalar must be finite and >= 0, got {value}")
        if value == 0:
            return FixedScalar(0, 0)
        shift = num_bits - 1 - math.floor(math.log2(value))
        num = int(math.floor(math.ldexp(value, shift) + 0.5))  # 2.0**shift overflows at 5e-324
        if num >= 1 << num_bits:  # rounding carried into the next power of two
            num, shift = num >> 1, shift - 1
        return FixedScalar(num, shift)

    @staticmethod
    def signed(value: float) -> FixedScalar:
        """A constant of either sign (the scale op's: x * -1 of a subtraction): the
        magnitude's FixedScalar.of with the sign on num (|num| < 2^15)."""
        magnitude = FixedScalar.of(abs(value))
        return FixedScalar(-magnitude.num if value < 0 else magnitude.num, magnitude.shift)

    def __float__(self) -> float:
        return math.ldexp(self.num, -self.shift)


# --------------------------------------------------------------------------- weight update


@dataclass(frozen=True)
class UpdateConfig:
    bits: int
    lr: FixedScalar
    momentum: FixedScalar
    weight_decay: FixedScalar
    rounding: Rounding = "stochastic"
    channels: bool = False  # channel exponents (section 5): w's rows share an int8 frame


def row_count(shape: tuple[int, ...]) -> int:
    """The rows of a weight of `shape`: its first axis, or one row for a 0-dim parameter (a
    learnable scalar). Its velocity groups and channel exponents are per row."""
    return int(shape[0]) if shape else 1


def row_geometry(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a weight's (shape[0], -1) reshape (weight_rows): the layout
    its update kernels and channel exponents see."""
    rows = row_count(shape)
    return rows, int(np.prod(shape, dtype=np.int64)) // rows


def weight_rows(w_acc: np.ndarray, w: np.ndarray) -> np.ndarray:
    """w_acc as the (shape[0], -1) rows of w: the rows channel exponents round, whatever the
    velocity's groups (one per tensor without per-group velocity)."""
    return np.reshape(w_acc, (row_count(np.shape(w)), -1))


def weight_bound_bits(bits: int, channels: bool) -> int:
    """b with |w| < 2^b: B - 1, or 7 when the rows of w have channel exponents (|w| <= 127)."""
    return CONTAINER_BITS - 1 if channels and bits < CONTAINER_BITS else bits - 1


UPDATE_SITES = 16  # tensor ids reserved per parameter for the rounding sites of its update

# The velocity keeps 8-bit mantissas at every B (the paper's B < 8 runs keep INT8 velocity too):
# with B-bit velocity the Fashion CNN diverges at B = 4, in the float simulation as well
# (docs/benchmarks.md, "Ablations"). Weights, gradients and activations use B bits.
VELOCITY_BITS = 8


def update_keys(seed: int, step: int, tensor_id_base: int) -> list[int]:
    """Keys of the rounding sites of one parameter's update: tensor ids base + 0 .. base + 8."""
    return [stream_key(seed, step, tensor_id_base + site) for site in range(9)]


def sgd_momentum_update(
    w: np.ndarray,
    w_exp: int,
    grad_acc: np.ndarray,
    grad_exp: int,
    v: np.ndarray,
    v_exp: np.ndarray,
    cfg: UpdateConfig,
    keys: list[int],
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Integer SGD with momentum (paper section 3.3) for one parameter tensor.

    w: weight mantissa (int8) with one exponent w_exp. grad_acc: int32 gradient accumulator with one
    exponent grad_exp. v: velocity mantissa (shape of w) with one exponent per group: v_exp has
    shape (G,), G = w.shape[0] for per-group velocity (axis 0 = output channel / neuron) or G = 1.
    keys: the 9 rounding-site keys from `update_keys`.

    Steps (all integer; site numbers in brackets):
      1. g = compact(grad_acc) per group [0]
      2. g = compact(g + wd * w) per group, aligned sum [1, 2], compaction [3]  (skipped if wd = 0)
      3. v = compact(momentum * v + g) per group to VELOCITY_BITS, aligned sum [4, 5],
         compaction [6]
      4. u = lr * v (int32 product), exponent e_v - lr.shift; an all-zero w takes the
         coarsest update exponent (zero_weight_exponent)
      5. w_acc = w - align(u to w_exp): rounded right shift [7] or saturating exact left shift
      6. reactive rescale of w_acc back to B bits [8]
    Returns (w, w_exp, v, v_exp).
    """
    bits, rnd = cfg.bits, cfg.rounding
    groups = int(v_exp.shape[0])

    def grp(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.int64).reshape(groups, -1)

    b = bits - 1
    g, e_g = compact(grp(grad_acc), np.full(groups, grad_exp), bits, rnd, keys[0], grouped=True)
    if cfg.weight_decay.num:
        wd_term = grp(w) * cfg.weight_decay.num
        wd_bits = weight_bound_bits(bits, cfg.channels) + cfg.weight_decay.num.bit_length()
        wd_exp = np.full(groups, w_exp - cfg.weight_decay.shift)
        acc, e_acc = aligned_sum([(g, e_g, b), (wd_term, wd_exp, wd_bits)], rnd, keys[1:3])
        g, e_g = compact(acc, e_acc.reshape(groups), bits, rnd, keys[3], grouped=True)
    mom_term = grp(v) * cfg.momentum.num
    mom_bits = VELOCITY_BITS - 1 + max(cfg.momentum.num.bit_length(), 1)
    mom_exp = np.asarray(v_exp, np.int64) - cfg.momentum.shift
    acc, e_acc = aligned_sum([(mom_term, mom_exp, mom_bits), (g, e_g, b)], rnd, keys[4:6])
    v_new, v_exp_new = compact(
        acc, e_acc.reshape(groups), VELOCITY_BITS, rnd, keys[6], grouped=True
    )
    u = v_new.astype(np.int64) * cfg.lr.num
    w_exp = zero_weight_exponent(w, w_exp, u, v_exp_new - cfg.lr.shift)
    d = np.broadcast_to(expand_exponent(w_exp - (v_exp_new - cfg.lr.shift), 2), u.shape)
    right = shift_right(u, np.maximum(d, 0), rnd, keys[7])
    left = shift_left_saturating(u, np.maximum(-d, 0))
    w_acc = grp(w) - np.where(d >= 0, right, left)
    check_int32(w_acc, "weight_update")
    w_new, w_exp_new = reactive_rescale(
        weight_rows(w_acc, w), w_exp, bits, rnd, keys[8], cfg.channels
    )
    return w_new.reshape(w.shape), w_exp_new, v_new.reshape(v.shape), v_exp_new


@dataclass(frozen=True)
class AdamConfig:
    """The constants of one AdamW step (docs/numerics.md section 12b): the static 1 - beta of
    each moment, the per-step lr_t, eps_t and wd_t, and Adam's static L2 decay."""

    bits: int
    one_minus_beta1: FixedScalar
    one_minus_beta2: FixedScalar
    lr: FixedScalar
    eps: FixedScalar
    weight_decay: FixedScalar
    rounding: Rounding = "stochastic"
    l2: FixedScalar = FixedScalar(0, 0)  # Adam's coupled decay (step 1b); AdamW: 0
    channels: bool = False  # channel exponents (section 5): w's rows share an int8 frame


MOMENT_BITS = 8  # AdamW's m and r keep 8-bit mantissas at every B (as the SGD velocity)
MOMENT_EXP0 = -(1 << 14)  # the exponent of a zero moment at the start: below every step's
RATIO_FRAC = 7  # fraction bits of q = m / (r + eps)
RATIO_CAP = 16 << RATIO_FRAC  # |q| <= 16 (the exact ratio is below 7.3 at the default betas)
DENOM_FRAC = 8  # fraction bits of D = r + eps
ADAMW_SITES = 15


def adamw_keys(seed: int, step: int, tensor_id_base: int) -> list[int]:
    """Keys of the rounding sites of one parameter's AdamW update: tensor ids base + 0..14."""
    return [stream_key(seed, step, tensor_id_base + site) for site in range(ADAMW_SITES)]


def root_exponent_shift(e_v: np.ndarray) -> np.ndarray:
    """k of section 12b step 4: 30 or 31, so that e_v - k is even."""
    return 30 + (np.asarray(e_v, np.int64) - 30) % 2


def adam_ratio(
    m: np.ndarray, m_exp: np.ndarray, r: np.ndarray, r_exp: np.ndarray, eps: FixedScalar
) -> tuple[np.ndarray, np.ndarray]:
    """q = m / (r + eps) with RATIO_FRAC fraction bits, clamped to +-RATIO_CAP, per group
    exponents e_m - e_r - RATIO_FRAC (section 12b step 5). m, r: (G, -1); exponents (G,)."""
    s = eps.shift + np.asarray(r_exp, np.int64) - DENOM_FRAC
    num = np.full(s.shape, eps.num, np.int64)
    right = shift_right(num, np.maximum(s, 0), "nearest")
    e_units = np.where(s >= 0, right, shift_left_saturating(num, np.maximum(-s, 0)))
    d = (np.asarray(r, np.int64) << DENOM_FRAC) + e_units[:, None]
    mv = np.asarray(m, np.int64)
    q = idiv_round(mv << (DENOM_FRAC + RATIO_FRAC), np.maximum(d, 1))
    q = np.where(d == 0, np.sign(mv) * RATIO_CAP, np.clip(q, -RATIO_CAP, RATIO_CAP))
    return q, np.asarray(m_exp, np.int64) - np.asarray(r_exp, np.int64) - RATIO_FRAC


def adamw_update(
    w: np.ndarray,
    w_exp: int,
    grad_acc: np.ndarray,
    grad_exp: int,
    m: np.ndarray,
    m_exp: np.ndarray,
    r: np.ndarray,
    r_exp: np.ndarray,
    cfg: AdamConfig,
    keys: list[int],
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Integer AdamW (docs/numerics.md section 12b) for one parameter tensor: w (B-bit, one
    exponent), the first moment m and the root second moment r (8-bit, exponents of shape
    (G,)), the int32 gradient accumulator. keys: the ADAMW_SITES keys from `adamw_keys`.
    Returns (w, w_exp, m, m_exp, r, r_exp)."""
    bits, rnd = cfg.bits, cfg.rounding
    groups = int(np.size(m_exp))

    def grp(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.int64).reshape(groups, -1)

    b, wb = bits - 1, weight_bound_bits(bits, cfg.channels)
    g8, e_g = compact(grp(grad_acc), np.full(groups, grad_exp), bits, rnd, keys[0], grouped=True)
    if cfg.l2.num:  # Adam's L2 as a gradient term (step 1b)
        wd_term = grp(w) * cfg.l2.num
        wd_exp = np.full(groups, w_exp - cfg.l2.shift)
        acc, e_acc = aligned_sum(
            [(g8, e_g, b), (wd_term, wd_exp, wb + cfg.l2.num.bit_length())], rnd, keys[12:14]
        )
        g8, e_g = compact(acc, e_acc.reshape(groups), bits, rnd, keys[14], grouped=True)
    g = g8.astype(np.int64)
    c1, c2 = cfg.one_minus_beta1, cfg.one_minus_beta2
    mm = grp(m)
    e_m0 = np.asarray(m_exp, np.int64).reshape(groups)
    m_bits = MOMENT_BITS - 1
    # m + c1 (g - m): beta1 itself is never rounded (docs/numerics.md 12b, "Constants")
    acc, e_acc = aligned_sum(
        [
            (mm, e_m0, m_bits),
            (-mm * c1.num, e_m0 - c1.shift, m_bits + c1.num.bit_length()),
            (g * c1.num, e_g - c1.shift, b + c1.num.bit_length()),
        ],
        rnd,
        keys[1:4],
    )
    m_new, e_m = compact(acc, e_acc.reshape(groups), MOMENT_BITS, rnd, keys[4], grouped=True)
    r2 = grp(r) ** 2
    e_r2 = 2 * np.asarray(r_exp, np.int64).reshape(groups)
    acc, e_v = aligned_sum(
        [
            (r2, e_r2, 2 * m_bits),
            (-r2 * c2.num, e_r2 - c2.shift, 2 * m_bits + c2.num.bit_length()),
            (g * g * c2.num, 2 * e_g - c2.shift, 2 * b + c2.num.bit_length()),
        ],
        rnd,
        keys[5:8],
    )
    e_v = e_v.reshape(groups)
    k = root_exponent_shift(e_v)
    rho = isqrt(np.maximum(acc, 0) << k[:, None])
    r_new, e_r = compact(rho, (e_v - k) // 2, MOMENT_BITS, rnd, keys[8], grouped=True)
    q, e_q = adam_ratio(m_new, e_m, r_new, e_r, cfg.eps)
    u = q * cfg.lr.num
    w_exp = zero_weight_exponent(w, w_exp, u, e_q - cfg.lr.shift)
    d = np.broadcast_to(expand_exponent(w_exp - (e_q - cfg.lr.shift), 2), u.shape)
    right = shift_right(u, np.maximum(d, 0), rnd, keys[9])
    left = shift_left_saturating(u, np.maximum(-d, 0))
    decay = shift_right(grp(w) * cfg.weight_decay.num, cfg.weight_decay.shift, rnd, keys[10])
    w_acc = grp(w) - np.where(d >= 0, right, left) - decay
    check_int32(w_acc, "weight_update")
    w_new, w_exp_new = reactive_rescale(
        weight_rows(w_acc, w), w_exp, bits, rnd, keys[11], cfg.channels
    )
    shape = np.shape(w)
    return (
        w_new.reshape(shape),
        w_exp_new,
        m_new.reshape(shape),
        e_m,
        r_new.reshape(shape),
        e_r,
    )


def zero_weight_exponent(w: np.ndarray, w_exp: int, u: np.ndarray, e_u: np.ndarray) -> int:
    """The exponent the update aligns to: w_exp, or, if every mantissa of w is zero, the largest
    exponent e_u of a group whose update is nonzero.

    An all-zero tensor (a BN shift or a bias initialized to 0) has no scale of its own; its
    exponent is whatever quantization gave it (0 for zeros). Aligning a small update to that
    exponent rounds it to 0 or to a whole unit, so the parameter would stay exactly 0 for hundreds
    of steps and then jump by 2^e_w (1.0 for a zero BN shift). Taking the coarsest group exponent
    of u instead loses no update (u fits int32) and reactive rescale then rounds once to B bits.
    """
    if np.any(w) or not np.any(u):
        return w_exp
    live = np.any(np.reshape(u, (np.size(e_u), -1)) != 0, axis=1)  # groups with an update
    return int(np.max(np.reshape(e_u, -1)[live]))


def reactive_rescale(
    w_acc: np.ndarray,
    w_exp: int,
    bits: int,
    rounding: Rounding,
    key: int,
    channels: bool = False,
) -> tuple[np.ndarray, int]:
    """Bring an updated weight accumulator back to B bits (one exponent per tensor).

    max|w| > qmax: right shift by the smallest s that fits (rounded); max|w| in (0, qmax/2]:
    exact left shift by the largest s with max|w| * 2^s <= qmax; otherwise unchanged.
    `channels`: each row of w_acc (G, -1) gets its own B-bit exponent inside the tensor's int8
    frame (channel_compact, signed shifts).
    """
    if channels and bits < CONTAINER_BITS:
        out = channel_compact(w_acc, w_exp, bits, rounding, key, 0, signed=True)
        if out is not None:
            return out[0], out[1]
    q = qmax(bits)
    m = int(np.abs(w_acc).max()) if w_acc.size else 0
    if m > q:
        s = int(compaction_shift(m, bits))
        return saturate(shift_right(w_acc, s, rounding, key), bits), w_exp + s
    if m == 0:
        return saturate(w_acc, bits), w_exp
    s = -int(natural_shift(np.asarray(m), bits, signed=True))  # the largest left shift that fits
    return saturate(np.asarray(w_acc, np.int64) << s, bits), w_exp - s


# --------------------------------------------------------------------------- checksum

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3


def fnv1a64(data: bytes, h: int = FNV64_OFFSET) -> int:
    """FNV-1a 64-bit hash of `data`, continuing from `h`."""
    mask = (1 << 64) - 1
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & mask
    return h


def state_checksum(state: dict[str, tuple[np.ndarray, np.ndarray]]) -> str:
    """FNV-1a 64 over every persistent tensor in sorted name order: mantissa bytes (C order),
    then each exponent as int32 little-endian. 16 lowercase hex digits."""
    h = FNV64_OFFSET
    for name in sorted(state):
        mant, exps = state[name]
        h = fnv1a64(np.ascontiguousarray(mant, dtype=np.int8).tobytes(), h)
        h = fnv1a64(np.ascontiguousarray(exps, dtype="<i4").tobytes(), h)
    return f"{h:016x}"
