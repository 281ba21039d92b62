"""Integer SGD with momentum: sgd_momentum_update and reactive_rescale."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx


def cfg(lr: float, mom: float, wd: float, rounding: nx.Rounding = "stochastic") -> nx.UpdateConfig:
    return nx.UpdateConfig(
        8, nx.FixedScalar.of(lr), nx.FixedScalar.of(mom), nx.FixedScalar.of(wd), rounding
    )


def test_update_keys_are_sites_0_to_8() -> None:
    keys = nx.update_keys(3, 4, 160)
    assert keys == [nx.stream_key(3, 4, 160 + i) for i in range(9)]
    assert nx.UPDATE_SITES == 16


@given(
    seed=st.integers(0, 2**32 - 1),
    first_step=st.booleans(),
    rounding=st.sampled_from(nx.ROUNDINGS),
)
def test_one_step_matches_float_sgd(seed: int, first_step: bool, rounding: nx.Rounding) -> None:
    """One step vs float SGD-momentum on dequantized values, with the FixedScalar values of
    lr / momentum / wd, so the difference is only the predicted quantization error:
    |v err| < 2^e_g (gradient compaction) + [2^e_g' (wd compaction)] + 2^e_v' (velocity),
    |w err| < lr * |v err| + 2^e_w (update alignment) + 2^e_w' (reactive rescale)."""
    rng = np.random.default_rng(seed)
    c = cfg(0.05, 0.9, 1e-3 if first_step else 0.0, rounding)
    w = rng.integers(-127, 128, size=(6, 10)).astype(np.int8)
    w_exp = -7
    scale = 2.0 ** rng.integers(0, 16, size=(6, 1))  # groups of very different magnitude
    grad_acc = np.round(rng.normal(size=(6, 10)) * scale).astype(np.int64)
    grad_exp = -18
    if first_step:
        v = np.zeros((6, 10), np.int8)
    else:
        v = rng.integers(-127, 128, size=(6, 10)).astype(np.int8)
    v_exp = rng.integers(-16, -8, size=6).astype(np.int64)
    keys = nx.update_keys(seed, 1, 32)
    w2, w_exp2, v2, v_exp2 = nx.sgd_momentum_update(w, w_exp, grad_acc, grad_exp, v, v_exp, c, keys)
    assert w2.dtype == np.int8 and v2.dtype == np.int8 and v_exp2.shape == (6,)
    assert np.abs(w2.astype(int)).max() <= 127 and np.abs(v2.astype(int)).max() <= 127

    lr, mom, wd = float(c.lr), float(c.momentum), float(c.weight_decay)
    wf = w * 2.0**w_exp
    g = grad_acc * 2.0**grad_exp + wd * wf
    vf = mom * v * 2.0 ** v_exp[:, None] + g
    w_ref = wf - lr * vf

    e_g = grad_exp + nx.compaction_shift(np.abs(grad_acc).max(axis=1), 8)
    v_bound = 2.0**e_g + 2.0**v_exp2 * (2 if first_step and wd else 1)  # first step: e_g' = e_v'
    v_got = v2 * 2.0 ** v_exp2[:, None]
    assert np.all(np.abs(v_got - vf) < v_bound[:, None])
    w_got = w2 * 2.0**w_exp2
    w_bound = lr * v_bound[:, None] + 2.0**w_exp + 2.0**w_exp2
    assert np.all(np.abs(w_got - w_ref) < w_bound)


def test_per_group_velocity_keeps_small_groups() -> None:
    """One large-gradient row and one small one: a shared velocity exponent flushes the small
    row to zero, per-group exponents keep it."""
    c = cfg(0.01, 0.9, 0.0, "nearest")
    w = np.full((2, 4), 64, np.int8)
    grad = np.array([[2**20, -(2**20), 2**19, 7], [3, -2, 1, 2]], dtype=np.int64)
    keys = nx.update_keys(0, 0, 0)
    v0 = np.zeros((2, 4), np.int8)
    _, _, v_g, e_g = nx.sgd_momentum_update(w, -7, grad, -24, v0, np.full(2, -24), c, keys)
    _, _, v_s, e_s = nx.sgd_momentum_update(w, -7, grad, -24, v0, np.full(1, -24), c, keys)
    assert e_g.shape == (2,) and e_s.shape == (1,)
    # per group: the small row is kept exactly (first step, v = 0: v' = g)
    assert np.array_equal(v_g[1] * 2.0 ** e_g[1], grad[1] * 2.0**-24)
    assert np.all(v_g[1] != 0)
    # shared exponent: set by the 2^20 entries, the small row rounds to zero
    assert v_s[1].tolist() == [0, 0, 0, 0]
    assert v_g[0].tolist() == v_s[0].tolist() and int(e_g[0]) == int(e_s[0])


def test_reactive_rescale_overflow_right_shifts() -> None:
    c = cfg(1.0, 0.0, 0.0, "nearest")
    w = np.full((2, 3), 127, np.int8)
    grad = np.full((2, 3), -127, np.int64)  # update +127 at w_exp: w_acc = 254
    w2, e2, _, _ = nx.sgd_momentum_update(
        w,
        -5,
        grad,
        -5,
        np.zeros((2, 3), np.int8),
        np.zeros(2, np.int64),
        c,
        nx.update_keys(0, 0, 0),
    )
    assert e2 == -4 and np.all(w2 == 127)  # 254 / 2 = 127 at one exponent higher


def test_reactive_rescale_under_use_left_shifts() -> None:
    c = cfg(1.0, 0.0, 0.0, "nearest")
    w = np.array([[10, -3], [0, 5]], np.int8)
    w2, e2, _, _ = nx.sgd_momentum_update(
        w,
        -5,
        np.zeros((2, 2), np.int64),
        0,
        np.zeros((2, 2), np.int8),
        np.zeros(2, np.int64),
        c,
        nx.update_keys(0, 0, 0),
    )
    assert e2 == -8 and w2.tolist() == [[80, -24], [0, 40]]  # exact x8; 160 would not fit


@given(m=st.integers(0, 2**30), bits=st.integers(2, 8), rounding=st.sampled_from(nx.ROUNDINGS))
def test_reactive_rescale_direct(m: int, bits: int, rounding: nx.Rounding) -> None:
    q = nx.qmax(bits)
    w_acc = np.array([m, -m // 3, 1 if m else 0])
    w2, e2 = nx.reactive_rescale(w_acc, 0, bits, rounding, key=5)
    top = int(np.abs(w2.astype(int)).max())
    assert top <= q
    if m > q:
        assert e2 == int(nx.compaction_shift(m, bits)) and e2 > 0
    elif m == 0:
        assert e2 == 0 and top == 0
    else:
        assert e2 <= 0 and m * 2 ** (-e2) <= q < m * 2 ** (1 - e2)
        assert np.array_equal(w2, w_acc * 2 ** (-e2))  # left shifts are exact


def test_update_rejects_nothing_silently_in_debug_mode() -> None:
    c = cfg(0.1, 0.9, 5e-4)
    rng = np.random.default_rng(1)
    w = rng.integers(-127, 128, size=(4, 8)).astype(np.int8)
    v = rng.integers(-127, 128, size=(4, 8)).astype(np.int8)
    grad = rng.integers(-(2**30), 2**30, size=(4, 8))
    with nx.overflow_debug():
        out = nx.sgd_momentum_update(
            w, -7, grad, -40, v, np.full(4, -9), c, nx.update_keys(1, 2, 48)
        )
    assert out[0].dtype == np.int8


@pytest.mark.parametrize("rounding", nx.ROUNDINGS)
def test_update_deterministic(rounding: nx.Rounding) -> None:
    c = cfg(0.1, 0.9, 5e-4, rounding)
    w = np.arange(-12, 12, dtype=np.int8).reshape(3, 8)
    grad = np.arange(24, dtype=np.int64).reshape(3, 8) * 1000 - 9000
    args = (w, -6, grad, -20, w.copy(), np.full(3, -10), c, nx.update_keys(9, 9, 16))
    a = nx.sgd_momentum_update(*args)
    b = nx.sgd_momentum_update(*args)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_all_zero_weight_takes_the_update_exponent(rounding: nx.Rounding) -> None:
    """A zero-initialized parameter (BN shift, bias) at exponent 0 must learn from its first
    small update: aligned to 2^0 a 1e-3 update would round to 0 (or a whole 1.0)."""
    c = nx.UpdateConfig(
        8, nx.FixedScalar.of(0.05), nx.FixedScalar.of(0.9), nx.FixedScalar(0, 0), rounding
    )
    w = np.zeros(4, np.int8)
    grad = np.array([100, -50, 0, 25], np.int32)  # 100 * 2^-16 ~ 1.5e-3
    v0 = np.zeros(4, np.int8)
    keys = nx.update_keys(5, 0, 16)
    w2, e2, v2, ve2 = nx.sgd_momentum_update(w, 0, grad, -16, v0, np.zeros(4, np.int64), c, keys)
    want = -0.05 * grad * 2.0**-16
    got = w2 * 2.0**e2
    assert np.abs(w2).max() > 63  # rescaled to use the 8-bit range
    assert np.allclose(got, want, rtol=0.02, atol=0)
    # with one group (shared velocity exponent) as well
    w3, e3, _, _ = nx.sgd_momentum_update(w, 0, grad, -16, v0, np.zeros(1, np.int64), c, keys)
    assert np.allclose(w3 * 2.0**e3, want, rtol=0.02, atol=0)
    # a zero update leaves an all-zero weight and its exponent alone
    w4, e4, _, _ = nx.sgd_momentum_update(w, 0, grad * 0, -16, v0, np.zeros(4, np.int64), c, keys)
    assert not w4.any() and e4 == 0


@pytest.mark.parametrize("bits", [4, 6])
def test_velocity_keeps_eight_bits_below_eight(bits: int) -> None:
    """At B < 8 the weight is rescaled to B bits but the velocity compacted to VELOCITY_BITS."""
    c = nx.UpdateConfig(
        bits, nx.FixedScalar.of(0.05), nx.FixedScalar.of(0.9), nx.FixedScalar(0, 0), "nearest"
    )
    q = nx.qmax(bits)
    w = np.array([[q, -q, 1, 0], [2, -1, 0, q]], np.int8)
    v0 = np.array([[100, -90, 50, 3], [127, 0, -64, 8]], np.int8)
    grad = np.array([[40, -30, 25, 7], [60, -20, 5, 1]], np.int64)  # 2^-16: small beside v
    keys = nx.update_keys(1, 0, 16)
    w2, _, v2, ve2 = nx.sgd_momentum_update(w, -3, grad, -16, v0, np.full(2, -10), c, keys)
    assert nx.VELOCITY_BITS == 8 and np.abs(w2).max() <= q
    # 0.9 * 100 + 0.62 and 0.9 * 127 + 1.0 (units of 2^-10): beyond qmax(B)
    assert np.abs(v2).max(axis=1).tolist() == [91, 115]
    want = 0.9 * v0 * 2.0**-10 + grad * 2.0**-16
    assert np.abs(v2 * 2.0 ** ve2[:, None] - want).max() <= 2.0 ** ve2.max()
