import numpy as np
import pytest
import torch.nn.functional as F
from kernel_helpers import cos, rand_mx, tt

from mexc.kernels import (
    avgpool2d_backward,
    avgpool2d_forward,
    global_avgpool_backward,
    global_avgpool_forward,
    maxpool2d_backward,
    maxpool2d_forward,
)
from mexc.mx import RoundCtx


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_maxpool_matches_torch(k: int, s: int, p: int) -> None:
    rng = np.random.default_rng(k + s + p)
    ctx = RoundCtx("stochastic", 0, 1)
    x = rand_mx(rng, (8, 8, 8, 8), -5)
    y, arg = maxpool2d_forward(x, k, s, p)
    xt = tt(x, True)
    yt = F.max_pool2d(xt, k, s, p)
    assert np.array_equal(y.dequantize(), yt.detach().numpy())
    dy = rand_mx(rng, y.shape, -9)
    yt.backward(tt(dy))
    dx = maxpool2d_backward(dy, arg, x.shape, k, s, p, ctx, 0)
    if k == s:
        assert np.array_equal(dx.dequantize(), xt.grad.numpy())  # no overlap: exact
    assert cos(dx.dequantize(), xt.grad) >= 0.99


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_avgpool_matches_torch(k: int, s: int, p: int) -> None:
    rng = np.random.default_rng(k * s + p)
    ctx = RoundCtx("stochastic", 0, 1)
    x = rand_mx(rng, (8, 8, 8, 8), -5)
    y = avgpool2d_forward(x, k, s, p, ctx, 0)
    xt = tt(x, True)
    yt = F.avg_pool2d(xt, k, s, p)
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, y.shape, -9)
    yt.backward(tt(dy))
    dx = avgpool2d_backward(dy, x.shape, k, s, p, ctx, 16)
    assert cos(dx.dequantize(), xt.grad) >= 0.99


def test_global_avgpool_matches_torch() -> None:
    rng = np.random.default_rng(3)
    ctx = RoundCtx("nearest")
    x = rand_mx(rng, (8, 16, 7, 7), -5)
    y = global_avgpool_forward(x, ctx, 0)
    xt = tt(x, True)
    yt = F.adaptive_avg_pool2d(xt, 1)
    assert y.shape == (8, 16, 1, 1)
    assert np.allclose(y.dequantize(), yt.detach().numpy(), atol=2.0 ** float(y.e))
    dy = rand_mx(rng, y.shape, -9)
    yt.backward(tt(dy))
    dx = global_avgpool_backward(dy, x.shape, ctx, 16)
    assert cos(dx.dequantize(), xt.grad) >= 0.999
