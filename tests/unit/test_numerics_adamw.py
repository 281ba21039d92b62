"""Integer AdamW (docs/numerics.md section 12b): the pinned example, the first step's sign
update, the ratio's clamp, the root's exponent parity, and a noisy quadratic trained as
torch.optim.AdamW trains it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mexc.numerics import (
    MOMENT_EXP0,
    RATIO_CAP,
    FixedScalar,
    adam_ratio,
    adamw_keys,
    adamw_update,
    root_exponent_shift,
)
from mexc.optim import Adam, AdamW

W = np.array([[100, -50], [3, -4]], np.int8)
G_ACC = np.array([[40000, -1000], [30, -7]])
ZERO = np.zeros((2, 2), np.int8)
E0 = np.full(2, MOMENT_EXP0)


def test_the_spec_example() -> None:
    cfg = AdamW(lr=0.01, weight_decay=0.1).config(8, 0, "nearest")
    assert (cfg.lr, cfg.eps, cfg.weight_decay) == (
        FixedScalar(26527, 23),
        FixedScalar(22253, 46),
        FixedScalar(16777, 24),
    )
    assert (cfg.one_minus_beta1, cfg.one_minus_beta2) == (
        FixedScalar(26214, 18),
        FixedScalar(16777, 24),
    )
    w, we, m, me, r, re = adamw_update(
        W, -7, G_ACC, -20, ZERO, E0, ZERO, E0, cfg, adamw_keys(1, 0, 16)
    )
    assert w.tolist() == [[99, -49], [2, -3]] and we == -7
    assert m.tolist() == [[125, -3], [96, -22]] and me.tolist() == [-15, -25]
    assert r.tolist() == [[79, 2], [121, 28]] and re.tolist() == [-16, -27]


@pytest.mark.parametrize("seed", range(4))
def test_the_first_step_moves_each_weight_against_its_gradient(seed: int) -> None:
    """torch's first AdamW step is lr * sign(g) (m-hat / sqrt(v-hat) = +-1): with lr one unit
    of w, every weight moves by one unit against its gradient's sign, give or take the
    stochastic rounding's one unit."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-60, 60, (4, 16)).astype(np.int8)
    g = rng.integers(-(2**20), 2**20, (4, 16)) * rng.choice([1, 1000], (4, 1))
    g[g == 0] = 1
    cfg = AdamW(lr=2.0**-6, weight_decay=0.0).config(8, 0, "stochastic")
    e0 = np.full(4, MOMENT_EXP0)
    z = np.zeros_like(w)
    w2, we, *_ = adamw_update(w, -6, g, -30, z, e0, z, e0, cfg, adamw_keys(seed, 0, 0))
    moved = w2 * 2.0 ** (we + 6) - w  # in units of 2^-6 (the rescale may change e_w)
    assert np.all(-np.sign(g) * moved >= 0) and np.all(np.abs(moved) <= 2)
    assert abs(float(np.mean(np.abs(moved))) - 1.0) < 0.35


def test_ratio_is_clamped_where_rounding_left_r_at_zero() -> None:
    m = np.array([[5, -5, 0, 100]])
    r = np.array([[0, 0, 0, 1]])
    eps = FixedScalar(0, 0)
    q, e = adam_ratio(m, np.array([-10]), r, np.array([-10]), eps)
    assert q.tolist() == [[RATIO_CAP, -RATIO_CAP, 0, RATIO_CAP]] and e.tolist() == [-7]
    # an epsilon of one unit of r: 5 / (0 + 1) = 5 (with 7 fraction bits)
    q, _ = adam_ratio(m, np.array([-10]), r, np.array([-10]), FixedScalar(1, 10))
    assert q[0, :3].tolist() == [5 << 7, -(5 << 7), 0]


@pytest.mark.parametrize("e_v", [-31, -30, 0, 1, 7, -(2**15)])
def test_root_shift_makes_the_exponent_even(e_v: int) -> None:
    k = int(root_exponent_shift(np.array(e_v)))
    assert k in (30, 31) and (e_v - k) % 2 == 0


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_noisy_quadratic_trains_as_torch_adam(decoupled: bool) -> None:
    """300 steps of AdamW (or Adam with its coupled L2 decay) on w -> target with noisy
    gradients: the integer weights end as close to the target as torch's (within 5 %), and far
    from where they started."""
    rng = np.random.default_rng(0)
    target = rng.normal(size=(8, 64)) * np.exp(rng.normal(size=(8, 1)))
    w0 = rng.normal(size=(8, 64)) * 0.1
    opt = AdamW(lr=1e-2, weight_decay=0.1) if decoupled else Adam(lr=1e-2, weight_decay=0.1)
    e_w = int(np.ceil(np.log2(np.abs(w0).max() / 127)))
    wm, we = np.round(w0 / 2.0**e_w).astype(np.int8), e_w
    m = r = np.zeros((8, 64), np.int8)
    me = re = np.full(8, MOMENT_EXP0)
    tw = torch.tensor(w0, requires_grad=True)
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    topt = kind([tw], lr=1e-2, weight_decay=0.1)
    for step in range(300):
        noise = 0.5 * rng.normal(size=(8, 64))
        grad = wm * 2.0**we - target + noise
        ge = int(np.floor(np.log2(np.abs(grad).max()))) - 20
        gacc = np.round(grad / 2.0**ge).astype(np.int64)
        cfg = opt.config(8, step, "stochastic")
        keys = adamw_keys(1, step, 16)
        wm, we, m, me, r, re = adamw_update(wm, we, gacc, ge, m, me, r, re, cfg, keys)
        tw.grad = torch.tensor(tw.detach().numpy() - target + noise)
        topt.step()
    ours = float(np.abs(wm * 2.0**we - target).mean())
    theirs = float(np.abs(tw.detach().numpy() - target).mean())
    start = float(np.abs(w0 - target).mean())
    assert ours < 0.55 * start and abs(ours - theirs) < 0.05 * theirs


def test_hyperparameters_are_checked() -> None:
    with pytest.raises(ValueError, match="betas"):
        AdamW(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas"):
        AdamW(betas=0.9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr < 1"):
        AdamW(lr=1e-3, weight_decay=1e4)
    with pytest.raises(ValueError, match="eps"):
        AdamW(eps=float("nan"))
    adam = Adam(weight_decay=0.01)  # coupled: a static L2 term, no per-step decoupled decay
    assert adam.step_scalars(0)[2] == FixedScalar(0, 0) and adam.l2() == FixedScalar.of(0.01)
    assert AdamW(weight_decay=0.01).l2() == FixedScalar(0, 0)
