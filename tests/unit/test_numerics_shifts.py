"""Saturation, right shift with stochastic / nearest rounding, and the left shifts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx

I32 = st.integers(nx.INT32_MIN, nx.INT32_MAX)


def split_form_u32(x: np.ndarray, s: int, r: np.ndarray) -> np.ndarray:
    """The backend form in 32-bit arithmetic: (x >> s) + (((x & (2^s-1)) + r) >> s).

    x >> s is an arithmetic int32 shift; the inner sum is computed in uint32 (both addends are
    < 2^s <= 2^31, so it is < 2^32 and never wraps)."""
    x32 = np.asarray(x, dtype=np.int32)
    mask = np.uint32((1 << s) - 1)
    hi = (x32 >> np.int32(s)).astype(np.int32)
    inner = (x32.view(np.uint32) & mask) + (np.asarray(r, np.uint32) & mask)  # uint32, no wrap
    lo = (inner >> np.uint32(s)).astype(np.int32)  # 0 or 1
    return (hi + lo).astype(np.int64)


@pytest.mark.parametrize("bits", range(2, 9))
def test_saturation_bounds(bits: int) -> None:
    q = nx.qmax(bits)
    assert q == 2 ** (bits - 1) - 1
    x = np.arange(-(2**20), 2**20, 997, dtype=np.int64)
    x = np.concatenate([x, [nx.INT32_MIN, nx.INT32_MAX, q, -q, q + 1, -q - 1]])
    y = nx.saturate(x, bits)
    assert y.dtype == np.int8
    assert y.max() <= q and y.min() >= -q
    inside = np.abs(x) <= q
    assert np.array_equal(y[inside], x[inside])
    assert np.all(y[x > q] == q) and np.all(y[x < -q] == -q)


@pytest.mark.parametrize("bits", [1, 9, 0])
def test_qmax_rejects_bad_bits(bits: int) -> None:
    with pytest.raises(ValueError):
        nx.qmax(bits)


@given(x=I32, s=st.integers(1, 31), key=st.integers(0, 2**32 - 1))
def test_stochastic_is_floor_of_x_plus_r(x: int, s: int, key: int) -> None:
    xs = np.full(64, x, dtype=np.int64)
    out = nx.shift_right(xs, s, "stochastic", key)
    r = nx.element_bits(key, xs.shape).astype(np.int64) & ((1 << s) - 1)
    exact = (xs + r) >> s  # int64: the exact floor((x + r) / 2^s)
    assert np.array_equal(out, exact)
    assert np.array_equal(out, split_form_u32(xs, s, r))
    # never more than one unit from x / 2^s: out is floor or ceil of it
    assert np.all((out == (x >> s)) | (out == -((-x) >> s)))


@pytest.mark.parametrize("s", [1, 2, 3, 5, 8, 13, 31])
def test_stochastic_unbiased(s: int) -> None:
    rng = np.random.default_rng(s)
    xs = rng.integers(nx.INT32_MIN, nx.INT32_MAX, size=16, endpoint=True)
    n = 20000
    for j, x in enumerate(xs):
        out = nx.shift_right(np.full(n, x), s, "stochastic", key=1000 * s + j)
        err = out.astype(np.float64) - float(x) / 2.0**s
        frac = float(x) / 2.0**s - np.floor(float(x) / 2.0**s)
        se = max(np.sqrt(frac * (1 - frac) / n), 1e-12)  # Bernoulli(frac) standard error
        assert abs(err.mean()) <= 4 * se + 1e-9, (x, s, err.mean(), se)
        assert np.all(np.abs(err) < 1)


@given(x=I32, s=st.integers(0, 40))
def test_nearest_is_round_half_up(x: int, s: int) -> None:
    out = int(nx.shift_right(np.array([x]), s, "nearest")[0])
    if s >= 32:
        assert out == 0
    else:
        # floor(x / 2^s + 1/2) in exact integer arithmetic
        assert out == (2 * x + (1 << s)) // (1 << (s + 1))


def test_nearest_ties_go_up() -> None:
    x = np.array([-5, -3, -1, 1, 3, 5])
    assert nx.shift_right(x, 1, "nearest").tolist() == [-2, -1, 0, 1, 2, 3]


def test_split_form_extremes_no_overflow() -> None:
    """Near INT32_MIN / INT32_MAX with the largest r: the naive (x + r) >> s overflows int32,
    the split form does not, and both references agree with the exact int64 formula."""
    x = np.array(
        [nx.INT32_MIN, nx.INT32_MIN + 1, -1, 0, 1, nx.INT32_MAX - 1, nx.INT32_MAX], dtype=np.int64
    )
    for s in range(1, 32):
        rmax = np.full(x.shape, (1 << s) - 1, dtype=np.int64)
        assert np.array_equal(split_form_u32(x, s, rmax), (x + rmax) >> s)
        assert np.any(x + rmax > nx.INT32_MAX)  # the naive form would wrap
        for rnd in nx.ROUNDINGS:
            out = nx.shift_right(x, s, rnd, key=s)
            r = (
                nx.element_bits(s, x.shape).astype(np.int64) & ((1 << s) - 1)
                if rnd == "stochastic"
                else np.full(x.shape, 1 << (s - 1))
            )
            assert np.array_equal(out, (x + r) >> s)
            assert np.array_equal(out, split_form_u32(x, s, r))
            assert out.min() >= nx.INT32_MIN and out.max() <= nx.INT32_MAX


def test_shift_zero_and_large() -> None:
    x = np.array([nx.INT32_MIN, -7, 0, 7, nx.INT32_MAX])
    for rnd in nx.ROUNDINGS:
        assert np.array_equal(nx.shift_right(x, 0, rnd, key=3), x)
        for s in (32, 33, 63, 100):
            assert np.all(nx.shift_right(x, s, rnd, key=3) == 0)
    with pytest.raises(ValueError):
        nx.shift_right(x, -1, "nearest")


def test_per_element_shift_amounts() -> None:
    x = np.array([[100, 100, 100], [-100, -100, -100]])
    s = np.array([[0], [3]])
    out = nx.shift_right(x, s, "nearest")
    assert out.tolist() == [[100, 100, 100], [-12, -12, -12]]


@given(x=st.integers(-(2**15), 2**15), s=st.integers(0, 15))
def test_left_shift_exact(x: int, s: int) -> None:
    assert int(nx.shift_left(np.array([x]), s)[0]) == x * 2**s
    y = int(nx.shift_signed(np.array([x]), -s, "stochastic", key=9)[0])
    assert y == x * 2**s


@given(x=st.integers(-127, 127), s=st.integers(0, 80))
def test_left_shift_saturating(x: int, s: int) -> None:
    out = int(nx.shift_left_saturating(np.array([x]), s)[0])
    assert out == max(-(2**30), min(2**30, x * 2 ** min(s, 54)))
    assert abs(out) <= 2**30


@given(
    magnitudes=st.lists(st.integers(0, 30), min_size=2, max_size=6),
    bits=st.sampled_from([4, 6, 8]),
    key=st.integers(0, 2**32 - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_stochastic_rounding_in_pieces_equals_rounding_the_whole(
    magnitudes: list[int], bits: int, key: int, seed: int
) -> None:
    """docs/numerics.md §5, "Rounding in pieces": each piece rounded by its own shift s_j, then
    again by s - s_j with the bits of its words above s_j, is the compaction by s itself."""
    rng = np.random.default_rng(seed)
    per = 37
    acc = np.concatenate([rng.integers(-(2**b), 2**b + 1, per) for b in magnitudes])
    s = int(nx.compaction_shift(int(np.abs(acc).max()), bits))
    whole = nx.shift_right(acc, s, "stochastic", key)
    for j in range(len(magnitudes)):
        piece = acc[j * per : (j + 1) * per]
        s_j = int(nx.compaction_shift(int(np.abs(piece).max()), bits))
        y = nx.shift_right(piece, s_j, "stochastic", key, start=j * per)
        assert np.abs(y).max() <= nx.qmax(bits)
        w = nx.element_bits(key, piece.shape, j * per).astype(np.int64)
        d = s - s_j
        again = (y + ((w >> s_j) & ((1 << d) - 1))) >> d
        assert np.array_equal(again, whole[j * per : (j + 1) * per])


def test_nearest_rounding_does_not_compose_in_pieces() -> None:
    """Why a nearest site scans every piece before it rounds: 2^(s-1) rounds to 1 by s_j = s,
    and 1 to 1 again by one more bit, where the value itself gives 0 by s + 1."""
    x = np.array([1 << 4])
    once = nx.shift_right(x, 6, "nearest")
    twice = nx.shift_right(nx.shift_right(x, 5, "nearest"), 1, "nearest")
    assert once[0] == 0 and twice[0] == 1
