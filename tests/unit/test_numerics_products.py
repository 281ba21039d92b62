"""Products, compaction, static accumulator caps and the overflow debug mode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx

# docs/numerics.md, "Caps" table: K -> (cap B=8, B=6, B=4)
PRODUCT_CAPS = {
    9: (13, 17, 21),
    27: (12, 16, 20),
    144: (9, 13, 17),
    288: (8, 12, 16),
    4608: (4, 8, 12),
    100352: (0, 4, 8),
}


def test_product_cap_table() -> None:
    for k, caps in PRODUCT_CAPS.items():
        assert tuple(nx.product_cap(k, b) for b in (8, 6, 4)) == caps
    assert nx.product_cap(9, 8, 4) == 31 - (7 + 3 + 4)
    assert nx.sum_cap(2, 8) == 23 and nx.sum_cap(3, 8) == 22 and nx.sum_cap(1, 8) == 24


def test_ceil_log2() -> None:
    for n in range(1, 5000):
        c = nx.ceil_log2(n)
        assert 2**c >= n and (c == 0 or 2 ** (c - 1) < n)
    with pytest.raises(ValueError):
        nx.ceil_log2(0)


@pytest.mark.parametrize("bits", range(2, 9))
def test_worst_case_at_cap_fits_and_cap_zero_doubling_overflows(bits: int) -> None:
    q = nx.qmax(bits)
    for k in [1, 2, 3, 9, 27, 144, 288, 4608, 100352, 2**20]:
        cap = nx.product_cap(k, bits)
        if cap >= 0:
            # worst-case accumulator K * qmax^2, even with `cap` bits of extra input width
            assert k * q * q * 2**cap <= nx.INT32_MAX
    # the largest K with cap == 0: K * qmax^2 fits, but 2K can overflow
    k0 = 2 ** (31 - 2 * (bits - 1))
    assert nx.product_cap(k0, bits) == 0 and nx.product_cap(2 * k0, bits) == -1
    assert k0 * q * q <= nx.INT32_MAX
    if bits >= 5:  # for tiny qmax, (2^(B-1)-1)^2 leaves enough slack that 2K still fits
        assert 2 * k0 * q * q > nx.INT32_MAX
    # worst case as an actual product (B = 8: 2^17 * 127^2 fits, 2^18 * 127^2 does not)
    if bits == 8:
        a = np.full((1, k0), q, dtype=np.int64)
        assert int(nx.matmul_exact(a, a.T)[0, 0]) == k0 * q * q
        with nx.overflow_debug(), pytest.raises(nx.OverflowDebugError, match="'product'"):
            a2 = np.full((1, 2 * k0), q, dtype=np.int64)
            nx.matmul_exact(a2, a2.T)


@given(m=st.integers(0, nx.INT32_MAX), bits=st.integers(2, 8))
def test_compaction_shift_smallest(m: int, bits: int) -> None:
    q = nx.qmax(bits)
    s = int(nx.compaction_shift(m, bits))
    assert m <= q * 2**s
    assert s == 0 or m > q * 2 ** (s - 1)  # s - 1 would not fit


@given(
    bits=st.integers(2, 8),
    scale=st.integers(0, 31),
    seed=st.integers(0, 2**32 - 1),
    grouped=st.booleans(),
    rounding=st.sampled_from(nx.ROUNDINGS),
)
def test_compact_never_exceeds_qmax(
    bits: int, scale: int, seed: int, grouped: bool, rounding: nx.Rounding
) -> None:
    rng = np.random.default_rng(seed)
    hi = min(2**scale, nx.INT32_MAX)
    acc = rng.integers(-hi, hi, size=(4, 6), endpoint=True)
    acc[0, 0] = hi  # the extreme value is present
    acc[1] //= 1 << min(scale, 20)  # a small group
    m, e = nx.compact(acc, 3, bits, rounding, key=seed, grouped=grouped)
    q = nx.qmax(bits)
    assert m.dtype == np.int8 and np.abs(m.astype(int)).max() <= q
    gmax = nx.group_max_abs(acc, grouped)
    s = nx.compaction_shift(gmax, bits)
    assert np.array_equal(e, 3 + s)
    want = nx.shift_right(acc, nx.expand_exponent(s, 2), rounding, seed)
    assert np.array_equal(m, want)  # the saturate never has to clip
    # value preserved within one unit of the new exponent
    err = np.abs(m * 2.0 ** nx.expand_exponent(e, 2) - acc * 2.0**3)
    assert np.all(err < 2.0 ** nx.expand_exponent(e, 2))


def test_compact_grouped_keeps_small_groups() -> None:
    acc = np.array([[100000, -5000], [3, -2]])
    m_t, e_t = nx.compact(acc, 0, 8, "nearest")
    m_g, e_g = nx.compact(acc, 0, 8, "nearest", grouped=True)
    assert m_t[1].tolist() == [0, 0] and int(e_t) == 10
    assert m_g[1].tolist() == [3, -2] and e_g.tolist() == [10, 0]


def test_compact_respects_static_cap() -> None:
    acc = np.array([127 * 2**5])
    nx.compact(acc, 0, 8, "nearest", max_shift=5)
    with pytest.raises(nx.OverflowDebugError):
        nx.compact(acc + 1, 0, 8, "nearest", max_shift=5)


@given(
    k=st.integers(1, 300),
    bits_a=st.integers(2, 8),
    bits_b=st.integers(2, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_matmul_exact_float_branch(k: int, bits_a: int, bits_b: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    qa, qb = nx.qmax(bits_a), nx.qmax(bits_b)
    a = rng.integers(-qa, qa, size=(3, k), endpoint=True).astype(np.int8)
    b = rng.integers(-qb, qb, size=(k, 5), endpoint=True).astype(np.int8)
    assert np.array_equal(nx.matmul_exact(a, b), a.astype(np.int64) @ b.astype(np.int64))


def test_matmul_exact_int64_branch() -> None:
    # |a|max * |b|max * K >= 2^53 forces the int64 path; values chosen to need > 53 bits
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**30), 2**30, size=(4, 64))
    b = rng.integers(-(2**30), 2**30, size=(64, 3))
    a[0, 0] = 2**30 + 1
    want = np.array(
        [[sum(int(a[i, t]) * int(b[t, j]) for t in range(64)) for j in range(3)] for i in range(4)]
    )
    got = nx.matmul_exact(a, b)
    assert np.array_equal(got, want)
    assert np.abs(want).max() >= 2**53 or np.abs(a).max() * np.abs(b).max() * 64 >= 2**53


def test_overflow_debug_names_primitive_and_is_silent_when_off() -> None:
    a = np.full((1, 2**18), 127, dtype=np.int8)
    b = np.full((2**18, 1), 127, dtype=np.int8)
    out = nx.matmul_exact(a, b)  # off: the exact (int64) value comes back, no error
    assert int(out[0, 0]) == 2**18 * 127 * 127 > nx.INT32_MAX
    with nx.overflow_debug(), pytest.raises(nx.OverflowDebugError) as info:
        nx.matmul_exact(a, b)
    assert "'product'" in str(info.value)
    # the context manager restores the previous setting
    assert nx.set_overflow_debug(False) is False
    with nx.overflow_debug():
        nx.matmul_exact(a[:, :1000], b[:1000])  # fits: silent
        with pytest.raises(nx.OverflowDebugError, match="'shift_left'"):
            nx.shift_left(np.array([1]), 31)
        with pytest.raises(nx.OverflowDebugError, match="'shift_right'"):
            nx.shift_right(np.array([2**31]), 1, "nearest")


def test_negative_cap_pre_shift_rule() -> None:
    """cap < 0: pre-shift one operand right (rounded) by -cap bits; the product then fits."""
    k, bits = 2**18, 8
    cap = nx.product_cap(k, bits)
    assert cap == -1
    a = np.full((1, k), 127, dtype=np.int64)
    b_pre = nx.shift_right(np.full((k, 1), 127), -cap, "stochastic", key=1)
    assert np.abs(b_pre).max() <= 64  # ceil(127 / 2)
    with nx.overflow_debug():
        acc = nx.matmul_exact(a, b_pre)  # exponent of the result grows by -cap
    assert int(acc[0, 0]) <= nx.INT32_MAX
