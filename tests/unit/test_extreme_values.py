"""Values at the edges of float64 and of the schedules: inputs near 1e-307 and rates near
5e-324 are scaled by ldexp (2.0**k overflowed), predictions come from the integer logits at
any exponent, and a schedule that takes a rate past float's range, or AdamW's decay to a whole
weight, is refused by step with the state unchanged (llvm went on with a negative shift)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import InputError
from mexc.kernels import quantize
from mexc.mx import MX
from mexc.numerics import FixedScalar


def test_quantize_scales_by_ldexp_at_any_exponent() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000)
    q = quantize(x)
    e = int(q.e)
    want = np.clip(np.sign(x) * np.floor(np.abs(x) * 2.0**-e + 0.5), -127, 127)
    assert np.array_equal(q.m, want)  # the same bits as before at ordinary scales
    for scale in (1e-307, 1e-315):  # 2.0**-e overflowed at these (1e-315: subnormal)
        tiny = quantize(x * scale)
        assert int(tiny.e) < -1000 and np.count_nonzero(tiny.m) > 900
        step = math.ldexp(1.0, int(tiny.e))
        assert np.abs(tiny.dequantize() - x * scale).max() <= step


def test_fixed_scalars_of_denormal_rates() -> None:
    s = FixedScalar.of(5e-324)
    assert s.num > 0 and float(s) == 5e-324
    assert float(FixedScalar.of(0.05)) == pytest.approx(0.05, rel=2**-14)


def test_ordered_logits_keep_their_order_past_float64() -> None:
    m = np.array([[3, -7, 100], [5, 5, -1]], np.int8)
    huge, tiny = MX.of(m, 1020), MX.of(m, -1100)
    assert np.isinf(huge.dequantize()).any() and not tiny.dequantize().any()
    assert np.array_equal(huge.ordered(), m) and np.array_equal(tiny.ordered(), m)


def test_predict_reads_the_integer_logits_at_any_exponent() -> None:
    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
    prog = mexc.compile(nn.Sequential(nn.Linear(16, 10)), (torch.from_numpy(x),))
    want = prog.predict(x)
    assert len(set(want.tolist())) > 1
    for shift in (1040, -1100):  # both of the only layer's tensors: the logits scale by 2^shift
        state = dict(prog.state)
        for name in ("0.weight", "0.bias"):
            v = state[name]
            prog.state[name] = MX.of(v.m, np.asarray(v.e) + shift)
        logits = prog.logits(x)
        assert not np.isfinite(logits).all() if shift > 0 else not logits.any()
        assert np.array_equal(prog.predict(x), want)
        prog.state.update(state)


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_a_schedule_past_adamw_s_decay_rule_is_refused_by_step(target: str) -> None:
    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    y = np.arange(8) % 10
    opt = mexc.AdamW(lr=0.01, weight_decay=0.01, schedule=mexc.Step([2], gamma=4e8))
    prog = mexc.compile(nn.Linear(16, 10), (torch.from_numpy(x),), optimizer=opt, target=target)
    prog.step(x, y)
    prog.step(x, y)
    before = prog.state_checksum()
    with pytest.raises(InputError, match=r"AdamW at step 2: .* weight_decay 0.01 is 40000"):
        prog.step(x, y)
    assert prog.state_checksum() == before and prog.step_count == 2


def test_a_schedule_past_float_s_range_is_refused_by_step() -> None:
    opt = mexc.SGD(lr=0.05, schedule=mexc.Step([1, 2], gamma=1e300))
    assert math.isclose(float(opt.lr_at(1)), 5e298, rel_tol=2**-14)
    with pytest.raises(InputError, match=r"SGD at step 2: lr 0.05 under the schedule .* is inf"):
        opt.lr_at(2)


def test_a_weight_whose_outlier_zeroes_the_rest_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():
        model[0].weight[0, 0] = 1e4
    with pytest.warns(UserWarning, match=r"'0.weight': 2047 of its 2048 nonzero values round to 0"):
        mexc.compile(model, (torch.zeros(4, 64),))
