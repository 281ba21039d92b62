"""The kernels' fast paths are bit-identical to the numerics reference primitives."""

import numpy as np
import pytest

from mexc import numerics as nm
from mexc.kernels import _common as C


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("s", [0, 1, 5, 17, 30, 31, 33])
def test_shift_right_matches(rounding: str, s: int) -> None:
    rng = np.random.default_rng(s)
    x = rng.integers(-(2**31), 2**31, (7, 5, 3))
    ref = nm.shift_right(x, s, rounding, 1234)  # type: ignore[arg-type]
    assert np.array_equal(C.fast_shift_right(x, s, rounding, 1234), ref)  # type: ignore[arg-type]


def test_shift_right_per_channel_matches() -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(-(2**31), 2**31, (4, 6, 5))
    s = rng.integers(0, 34, (1, 6, 1))
    ref = nm.shift_right(x, np.broadcast_to(s, x.shape), "stochastic", 99)
    assert np.array_equal(C.fast_shift_right(x, s, "stochastic", 99), ref)


def test_element_bits_matches() -> None:
    for shape in [(3, 4), (2000,), (3, 700)]:
        assert np.array_equal(C.fast_element_bits(77, shape), nm.element_bits(77, shape))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("bits", [4, 8])
def test_compact_matches(rounding: str, bits: int) -> None:
    rng = np.random.default_rng(bits)
    for hi in [3, 100, 2**12, 2**30]:
        x = rng.integers(-hi, hi + 1, (9, 11))
        m, e = C.fast_compact(x, -3, bits, rounding, 5)  # type: ignore[arg-type]
        rm, re = nm.compact(x, -3, bits, rounding, 5)  # type: ignore[arg-type]
        assert np.array_equal(m, rm) and int(e) == int(re)
        m2, e2 = C.fast_compact_to_bits(x, -3, 15, rounding, 5)  # type: ignore[arg-type]
        rm2, re2 = nm.compact_to_bits(x, -3, 15, rounding, 5)  # type: ignore[arg-type]
        assert np.array_equal(m2, rm2) and int(e2) == int(re2)


def test_aligned_sum_matches() -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(-(2**20), 2**20, (4, 5, 6))
    b = rng.integers(-127, 128, (1, 5, 1))
    for ea, eb in [(-12, -7), (-3, -20), (0, 0)]:
        terms = [(a, ea, 21), (b, eb, 7)]
        ref = nm.aligned_sum(terms, "stochastic", [11, 12])  # type: ignore[arg-type]
        got = C.aligned_sum_fast(terms, "stochastic", [11, 12])  # type: ignore[arg-type]
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])


def test_int_matmul_matches() -> None:
    rng = np.random.default_rng(4)
    for k in [9, 1000, 70000]:
        a = rng.integers(-127, 128, (5, k))
        b = rng.integers(-127, 128, (k, 3))
        assert np.array_equal(C.int_matmul(a, b), nm.matmul_exact(a, b))


def test_compact_common_fits_and_is_one_exponent() -> None:
    from mexc.mx import RoundCtx

    rng = np.random.default_rng(5)
    acc = rng.integers(-(2**20), 2**20, (4, 3, 5))
    e = np.array([-10, -14, -12])
    out = C.compact_common(acc, e, 1, RoundCtx("nearest"), 0)
    assert out.e.ndim == 0
    want = acc * np.exp2(e.reshape(1, 3, 1).astype(float))
    assert np.allclose(out.dequantize(), want, atol=2.0 ** float(out.e))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("debug", [False, True])
def test_compact_common_zero_group_above_the_common_exponent(rounding: str, debug: bool) -> None:
    """An all-zero group whose exponent lies above the common one (E - e_g < 0, as a
    zero-variance channel in batch norm) stays 0; it is neither refused nor filled with
    rounding bits (docs/numerics.md section 5)."""
    from mexc.mx import RoundCtx
    from mexc.numerics import overflow_debug

    rng = np.random.default_rng(7)
    acc = rng.integers(-(2**20), 2**20, (64, 3, 70))  # >= 4096 elements: the int32 fast path too
    acc[:, 1] = 0
    e = np.array([-24, 0, -21])
    ctx = RoundCtx(rounding, seed=1, step=2, bits=8)  # type: ignore[arg-type]
    with overflow_debug(debug):
        out = C.compact_common(acc, e, 1, ctx, 5)
    assert int(out.e) < 0 and not np.any(out.m[:, 1])
    with overflow_debug(debug):
        alone = C.compact_common(acc[:, [0, 2]], e[[0, 2]], 1, ctx, 5)
    assert int(alone.e) == int(out.e)


def test_aligned_sum_per_channel_matches() -> None:
    rng = np.random.default_rng(6)
    a = rng.integers(-(2**14), 2**14, (4, 3, 5))
    b = rng.integers(-127, 128, (1, 3, 1))
    ea = np.array([-9, -20, -3]).reshape(1, 3, 1)
    terms = [(a, ea, 15), (b, -7, 7)]
    ref = nm.aligned_sum(terms, "stochastic", [1, 2])  # type: ignore[arg-type]
    got = C.aligned_sum_fast(terms, "stochastic", [1, 2])  # type: ignore[arg-type]
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
