"""aligned_sum: exponent alignment of M terms into one int32 accumulator."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx


def target_exponent(terms: list[tuple[int, int]]) -> int:
    """Spec formula for scalar exponents; terms = [(e_i, b_i)]."""
    m = len(terms)
    c = m.bit_length() if m > 1 else 0
    return max(min(e for e, _ in terms), max(e + b for e, b in terms) + c - 31)


term_st = st.tuples(st.integers(1, 31), st.integers(-40, 40))  # (b_i, e_i)


@given(
    spec=st.lists(term_st, min_size=1, max_size=9),
    seed=st.integers(0, 2**32 - 1),
    rounding=st.sampled_from(nx.ROUNDINGS),
    extreme=st.booleans(),
)
def test_aligned_sum_never_overflows(
    spec: list[tuple[int, int]], seed: int, rounding: nx.Rounding, extreme: bool
) -> None:
    rng = np.random.default_rng(seed)
    terms = []
    for b, e in spec:
        hi = 2**b - 1
        x = np.full(8, hi) if extreme else rng.integers(-hi, hi, size=8, endpoint=True)
        terms.append((x, e, b))
    keys = [seed + i for i in range(len(terms))]
    with nx.overflow_debug():
        acc, e = nx.aligned_sum(terms, rounding, keys)
    assert int(e) == target_exponent([(e_, b) for b, e_ in spec])
    assert acc.min() >= nx.INT32_MIN and acc.max() <= nx.INT32_MAX
    exact = sum(x.astype(object) * 2**e_ for x, e_, _ in terms)
    if all(e_ >= int(e) for _, e_, _ in terms):  # no right shift: the sum is exact
        assert np.all(acc.astype(object) * 2 ** int(e) == exact)
    else:  # each right-shifted term is off by less than one unit of 2^e
        n_right = sum(e_ < int(e) for _, e_, _ in terms)
        err = np.abs(acc.astype(object) * 2 ** int(e) - exact)
        assert np.all(err < n_right * 2 ** int(e))


def test_power_of_two_term_count_regression() -> None:
    """Two full-width int32 terms at the same exponent: both round up to 2^30 with ceil(log2 M);
    the target must leave room for that (this overflowed before the c = floor(log2 M) + 1 fix)."""
    x = np.array([nx.INT32_MAX])
    for rnd in nx.ROUNDINGS:
        with nx.overflow_debug():
            acc, e = nx.aligned_sum([(x, 0, 31), (x, 0, 31)], rnd, [1, 2])
        assert int(e) == 2 and int(acc[0]) <= nx.INT32_MAX
        assert abs(int(acc[0]) * 4 - 2 * nx.INT32_MAX) <= 2 * 4


def test_aligned_sum_worked_example() -> None:
    # docs/numerics.md, "aligned_sum" example
    a = np.array([100, -7])
    b = np.array([3, 120])
    acc, e = nx.aligned_sum([(a, -3, 7), (b, 2, 7)], "nearest")
    assert int(e) == -3 and acc.tolist() == [100 + 3 * 32, -7 + 120 * 32]
    acc, e = nx.aligned_sum([(a, -30, 7), (b, 2, 7)], "nearest")
    assert int(e) == -20  # max(-30, (2 + 7) + 2 - 31)
    assert acc.tolist() == [0 + 3 * 2**22, 0 + 120 * 2**22]  # 100 / 2^10 and -7 / 2^10 round to 0


def test_aligned_sum_grouped_exponents() -> None:
    x = np.array([[1, 2], [3, 4]])
    y = np.array([[10, 20], [30, 40]])
    acc, e = nx.aligned_sum([(x, np.array([0, -2]), 7), (y, np.array([1, 1]), 7)], "nearest")
    assert e.reshape(-1).tolist() == [0, -2]
    assert acc.tolist() == [[21, 42], [3 + 240, 4 + 320]]


def test_aligned_sum_one_key_per_term() -> None:
    x = np.arange(-50, 50) * 12345
    terms = [(x, 0, 31), (x, -40, 31)]
    a1, _ = nx.aligned_sum(terms, "stochastic", [5, 6])
    a2, _ = nx.aligned_sum(terms, "stochastic", [5, 7])
    a3, e = nx.aligned_sum(terms, "stochastic", [5, 6])
    assert np.array_equal(a1, a3)
    s0 = nx.shift_signed(x, np.full(x.shape, int(e) - 0), "stochastic", 5)
    s1 = nx.shift_signed(x, np.full(x.shape, int(e) + 40), "stochastic", 6)
    assert np.array_equal(a1, s0 + s1)
    assert not np.array_equal(a1, a2) or np.all(np.abs(x) < 2 ** (int(e) + 40 - 1))
