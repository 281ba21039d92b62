"""Batch norm on a channel whose variance is far below eps: as in float, x - mean is divided by
about sqrt(eps), so the channel stays near 0 instead of being normalized to unit scale
(docs/layers.md, BatchNorm step 4). The saturating eps of an earlier form got this wrong; the
MobileNetV3-Small accuracy run found it (docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mexc import kernels as K
from mexc.kernels.norm import _rstd
from mexc.mx import MX, RoundCtx
from mexc.numerics import FixedScalar


@pytest.mark.parametrize("e", [-4, -24, -32, -60])
def test_batch_norm_of_a_tiny_variance_matches_torch(e: int) -> None:
    rng = np.random.default_rng(0)
    x = MX.of(rng.integers(-127, 128, (64, 2, 2, 2)).astype(np.int8), e)
    gamma = MX.of(np.full(2, 64, np.int8), -6)  # 1.0
    beta = MX.of(np.zeros(2, np.int8), 0)
    y, _ = K.batchnorm_forward_train(x, gamma, beta, 1e-5, RoundCtx("nearest", 0, 0, 8), 0)
    xf = torch.from_numpy(x.m.astype(np.float64) * 2.0**e)
    want = torch.nn.functional.batch_norm(xf, None, None, training=True, eps=1e-5).numpy()
    got = y.m.astype(np.float64) * 2.0 ** float(y.e)
    # before the fix: max |got| 0.125 (e = -24) and 0.131 (e = -32), torch 0.0024 and 0.0
    assert np.abs(got - want).max() <= 0.02 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 1e-12, 0.0])
@pytest.mark.parametrize("ev", [-200, -90, -47, -46, -30, 0, 20])
def test_rstd_is_within_one_percent_of_float(ev: int, eps: float) -> None:
    """1/sqrt(var 2^ev + eps) over the whole range of variances, eps dominating or not."""
    var = np.array([0, 1, 3, 1 << 12, (1 << 29) + 12345, 1 << 30], np.int64)
    fixed = FixedScalar.of(eps)
    if float(fixed) < 2.0**ev:
        var = var[1:]  # eps rounds to 0 units of 2^ev: mexc clamps var + eps at 1 unit

    rstd, rstd_e = _rstd(var, np.full(var.shape, ev, np.int64), fixed)
    got = rstd.astype(np.float64) * np.exp2(rstd_e.astype(np.float64))
    want = 1.0 / np.sqrt(var * 2.0**ev + float(fixed))
    assert np.all(np.abs(got / want - 1) < 0.01)
