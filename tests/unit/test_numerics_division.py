"""div_const (reciprocal multiply), isqrt, idiv_round / idiv_floor, FixedScalar."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx

X16 = np.arange(-(2**15), 2**15 + 1, dtype=np.int64)  # every allowed input, both ends included


def exact_round_div(x: np.ndarray, o: int) -> np.ndarray:
    """Round-to-nearest of x / o for odd o (no ties), symmetric, in exact integer arithmetic."""
    ax = np.abs(x)
    return np.sign(x) * ((2 * ax + o) // (2 * o))


def test_div_const_every_divisor_every_int16() -> None:
    for d in range(1, 4097):
        r = nx.Reciprocal.of(d)
        assert r.odd % 2 == 1 and r.odd << r.pow2 == d
        q, e = nx.div_const(X16, 5, r)
        assert int(e) == 5 - r.pow2
        assert np.array_equal(q, exact_round_div(X16, r.odd)), d
        # the backend multiply needs a 64-bit (or 32x32->64) product, < 2^33
        n_max = 2**15 + (r.odd - 1) // 2
        assert n_max * r.mult < 2**33


@pytest.mark.parametrize("d", [1, 3, 7, 9, 49, 196, 255, 3136, 4095])
def test_div_const_matches_fractions(d: int) -> None:
    r = nx.Reciprocal.of(d)
    xs = np.array([-(2**15), -12345, -3, -1, 0, 1, 2, 3, 100, 4097, 2**15])
    q, e = nx.div_const(xs, 0, r)
    for x, got in zip(xs.tolist(), q.tolist()):
        f = Fraction(x, r.odd)
        want = math.floor(abs(f) + Fraction(1, 2)) * (1 if x >= 0 else -1)
        assert got == want
        # value check: got * 2^(0 - pow2) is the nearest multiple of 2^-pow2 to x / d
        assert abs(Fraction(got, 2**r.pow2) - Fraction(x, d)) <= Fraction(1, 2 ** (r.pow2 + 1))


def test_reciprocal_constants() -> None:
    # docs/numerics.md, div_const table
    assert nx.Reciprocal.of(1) == nx.Reciprocal(1, 0, 1, 65536, 16)
    assert nx.Reciprocal.of(3) == nx.Reciprocal(3, 0, 3, 87382, 18)
    assert nx.Reciprocal.of(12) == nx.Reciprocal(12, 2, 3, 87382, 18)
    assert nx.Reciprocal.of(49) == nx.Reciprocal(49, 0, 49, 85599, 22)
    with pytest.raises(ValueError):
        nx.Reciprocal.of(0)


def test_div_const_input_limit_and_compact_to_bits() -> None:
    r = nx.Reciprocal.of(3)
    with pytest.raises(ValueError, match="2\\^15"):
        nx.div_const(np.array([2**15 + 1]), 0, r)
    x = np.array([nx.INT32_MIN, -(2**20) + 3, 5, nx.INT32_MAX])
    for rnd in nx.ROUNDINGS:
        y, e = nx.compact_to_bits(x, 0, 15, rnd, key=4)
        assert np.abs(y).max() <= 2**15 and int(e) == 16
        nx.div_const(y, e, r)


def test_isqrt_all_below_2_20() -> None:
    n = np.arange(1 << 20, dtype=np.int64)
    r = nx.isqrt(n)
    assert np.all(r * r <= n) and np.all((r + 1) * (r + 1) > n)


@given(n=st.integers(0, 2**62 - 1))
def test_isqrt_matches_math(n: int) -> None:
    assert int(nx.isqrt(np.array([n]))[0]) == math.isqrt(n)


def test_isqrt_edges() -> None:
    ns = []
    for k in range(1, 2**31, 99991):
        ns += [k * k - 1, k * k, k * k + 1]
    ns += [2**62 - 1, (2**31 - 1) ** 2, (2**31 - 1) ** 2 - 1]
    ns = [v for v in ns if 0 <= v < 2**62]
    got = nx.isqrt(np.array(ns, dtype=np.int64)).tolist()
    assert got == [math.isqrt(v) for v in ns]
    with pytest.raises(ValueError):
        nx.isqrt(np.array([-1]))


@given(a=st.integers(-(2**40), 2**40), b=st.integers(1, 2**20))
def test_idiv_round_and_floor(a: int, b: int) -> None:
    f = Fraction(a, b)
    away = math.floor(abs(f) + Fraction(1, 2)) * (1 if a >= 0 else -1)  # ties away from zero
    assert int(nx.idiv_round(np.array([a]), b)[0]) == away
    assert int(nx.idiv_floor(np.array([a]), b)[0]) == math.floor(f)


def test_idiv_ties_and_errors() -> None:
    assert nx.idiv_round(np.array([-5, -3, -1, 1, 3, 5]), 2).tolist() == [-3, -2, -1, 1, 2, 3]
    assert nx.idiv_floor(np.array([-5, 5]), 2).tolist() == [-3, 2]
    with pytest.raises(ValueError):
        nx.idiv_round(np.array([1]), 0)
    with pytest.raises(ValueError):
        nx.idiv_floor(np.array([1]), -2)


@given(v=st.floats(1e-12, 1e6, allow_nan=False, allow_infinity=False))
def test_fixed_scalar_relative_error(v: float) -> None:
    f = nx.FixedScalar.of(v)
    assert 0 < f.num < 2**15
    assert abs(float(f) - v) / v < 2**-14


def test_fixed_scalar_examples() -> None:
    assert nx.FixedScalar.of(0.0) == nx.FixedScalar(0, 0)
    assert nx.FixedScalar.of(0.9) == nx.FixedScalar(29491, 15)
    assert nx.FixedScalar.of(0.1) == nx.FixedScalar(26214, 18)
    assert nx.FixedScalar.of(5e-4) == nx.FixedScalar(16777, 25)
    assert nx.FixedScalar.of(1.0) == nx.FixedScalar(16384, 14)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            nx.FixedScalar.of(bad)
