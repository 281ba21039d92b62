"""Channel exponents (docs/numerics.md §5): channel_compact, the weights' signed form and the
host's quantize_channels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mexc import numerics as nx
from mexc.kernels import quantize, quantize_channels


def test_the_spec_example() -> None:
    acc = np.array([[[640], [-40], [3]]])
    m, e = nx.channel_compact(acc, 0, 4, "nearest", 0, 1)  # type: ignore[misc]
    assert m.tolist() == [[[80], [-5], [0]]] and e == 3
    plain, e_plain = nx.compact(acc, 0, 4, "nearest")
    assert plain.tolist() == [[[5], [0], [0]]] and int(e_plain) == 7


def test_an_all_zero_tensor_takes_the_plain_rule() -> None:
    assert nx.channel_compact(np.zeros((2, 3, 4), np.int64), 5, 4, "nearest", 0, 1) is None


accumulators = st.integers(0, 2**32 - 1).map(
    lambda seed: (
        np.random.default_rng(seed).integers(-(2**20), 2**20, size=(3, 5, 4))
        >> np.random.default_rng(seed + 1).integers(0, 20, size=(1, 5, 1))
    )
)


@settings(max_examples=60, deadline=None)
@given(acc=accumulators, key=st.integers(0, 2**32 - 1), rounding=st.sampled_from(nx.ROUNDINGS))
def test_at_8_bits_it_is_the_plain_compaction(
    acc: np.ndarray, key: int, rounding: nx.Rounding
) -> None:
    got = nx.channel_compact(acc, -3, 8, rounding, key, 1)
    plain, e = nx.compact(acc, -3, 8, rounding, key)
    if got is None:
        assert not np.any(plain)
        return
    assert got[0].tolist() == plain.tolist() and got[1] == int(e)


@settings(max_examples=60, deadline=None)
@given(
    acc=accumulators,
    key=st.integers(0, 2**32 - 1),
    rounding=st.sampled_from(nx.ROUNDINGS),
    bits=st.integers(2, 7),
)
def test_every_channel_keeps_b_bits_in_the_int8_frame(
    acc: np.ndarray, key: int, rounding: nx.Rounding, bits: int
) -> None:
    out = nx.channel_compact(acc, -3, bits, rounding, key, 1)
    if out is None:
        assert not np.any(acc)
        return
    m, frame = out
    q = nx.qmax(bits)
    m64 = m.astype(np.int64)
    assert np.abs(m64).max() <= q << (8 - bits) <= 127
    amax = np.abs(acc).max(axis=(0, 2))
    x = -3 + nx.compaction_shift(amax, bits)
    assert frame == int(x[amax > 0].max()) - (8 - bits)
    for c in range(acc.shape[1]):
        t = max(int(x[c]), frame)
        unit = 1 << (t - frame)
        assert np.all(m64[:, c] % unit == 0)  # a B-bit mantissa at exponent t
        assert np.abs(m64[:, c] // unit).max() <= q
        # one rounding: within one unit of the channel's exponent of the exact value
        err = np.abs(m64[:, c] * 2.0**frame - acc[:, c] * 2.0**-3)
        assert err.max() < 2.0**t
        if amax[c] and t - frame == 8 - bits:
            # the largest channels round exactly as one exponent per tensor rounds them
            plain, e = nx.compact(acc, -3, bits, rounding, key)
            assert np.array_equal(plain[:, c].astype(np.int64) << (8 - bits), m64[:, c])
            assert int(e) == frame + 8 - bits


def test_small_channels_keep_bits_that_one_exponent_per_tensor_loses() -> None:
    rng = np.random.default_rng(0)
    acc = rng.integers(-1000, 1000, size=(16, 4, 5, 5)) * np.array([64, 8, 2, 1])[:, None, None]
    exact = acc.astype(np.float64)
    m, e = nx.channel_compact(acc, 0, 4, "nearest", 0, 1)  # type: ignore[misc]
    plain, e_plain = nx.compact(acc, 0, 4, "nearest")
    for c in range(4):
        ch = np.abs(m[:, c] * 2.0**e - exact[:, c]).mean()
        pt = np.abs(plain[:, c] * 2.0 ** int(e_plain) - exact[:, c]).mean()
        assert ch <= pt
        if c == 3:  # 64x below the largest: zero per tensor, 3 bits here
            assert not np.any(plain[:, c]) and np.any(m[:, c])


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_the_weights_signed_form_is_the_reactive_rescale_per_row(bits: int) -> None:
    rng = np.random.default_rng(bits)
    # rows far apart in size, the smallest below qmax / 2 (an exact left shift)
    w = rng.integers(-50, 50, size=(4, 9)) * np.array([4096, 64, 1, 0])[:, None]
    w[2, 0] = 1
    got, e = nx.reactive_rescale(w, -10, bits, "nearest", 7, channels=True)
    for r in range(3):
        rr, er = nx.reactive_rescale(w[r : r + 1], -10, bits, "nearest", 7)
        # each row's value is its own reactive rescale's, unless it lies below the frame
        if er >= e:
            assert np.array_equal(got[r].astype(np.int64) << 0, rr[0].astype(np.int64) << (er - e))
    assert not np.any(got[3])
    if bits == 8:
        plain, e8 = nx.reactive_rescale(w, -10, 8, "nearest", 7)
        assert np.array_equal(got, plain) and e == e8


def test_quantize_channels_rounds_each_row_in_the_frame() -> None:
    x = np.array([[0.9, -0.3], [0.01, 0.002], [0.0, 0.0]])
    mx = quantize_channels(x, 4)
    top = quantize(x[0], 4)
    assert int(mx.e) == int(top.e) - 4
    assert mx.m[0].tolist() == (top.m.astype(np.int64) << 4).tolist()
    assert mx.m[2].tolist() == [0, 0]
    # the second row, 2^6 below: 3 bits left, where one exponent per tensor leaves it 0
    assert np.any(mx.m[1]) and not np.any(quantize(x, 4).m[1])
    assert np.abs(mx.m.astype(np.int64)).max() <= 7 << 4
    assert quantize_channels(x, 8).m.tolist() == quantize(x, 8).m.tolist()


@pytest.mark.parametrize("groups", [2, 1])
def test_weight_rows_keep_their_exponents_whatever_the_velocity_groups(groups: int) -> None:
    """Without per-group velocity (one velocity exponent) the rows still round on their own."""
    w = quantize_channels(np.array([[0.9, -0.5, 0.3], [0.01, -0.02, 0.015]]), 4)
    cfg = nx.UpdateConfig(
        4, nx.FixedScalar.of(0.05), nx.FixedScalar.of(0.9), nx.FixedScalar(0, 0), "nearest", True
    )
    v_exp = np.zeros(groups, np.int64)
    keys = nx.update_keys(0, 0, 16)
    zero = np.zeros((2, 3), np.int64)
    wm, we, _, _ = nx.sgd_momentum_update(w.m, int(w.e), zero, 0, zero, v_exp, cfg, keys)
    assert wm.tolist() == w.m.tolist() and we == int(w.e)  # a zero step changes nothing
    assert np.any(wm[1])
