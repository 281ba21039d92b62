import numpy as np
from kernel_helpers import cos, rand_mx, same, tt

from mexc.kernels import (
    bias_backward,
    linear_backward_input,
    linear_backward_weight,
    linear_forward,
)
from mexc.mx import RoundCtx


def test_linear_matches_torch() -> None:
    rng = np.random.default_rng(0)
    ctx = RoundCtx("stochastic", 3, 4)
    x, w, b = rand_mx(rng, (16, 96), -5), rand_mx(rng, (32, 96), -8), rand_mx(rng, (32,), -6)
    y = linear_forward(x, w, b, ctx, 0)
    xt, wt, bt = tt(x, True), tt(w, True), tt(b, True)
    yt = xt @ wt.T + bt
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, y.shape, -9)
    yt.backward(tt(dy))
    dx = linear_backward_input(dy, w, ctx, 16)
    assert cos(dx.dequantize(), xt.grad) >= 0.99
    assert np.allclose(linear_backward_weight(dy, x).dequantize(), wt.grad.numpy())
    assert np.allclose(bias_backward(dy, (0,)).dequantize(), bt.grad.numpy())


def test_linear_deterministic_and_nearest() -> None:
    rng = np.random.default_rng(1)
    x, w = rand_mx(rng, (8, 64), -5), rand_mx(rng, (10, 64), -8)
    s = RoundCtx("stochastic", 0, 1)
    assert same(linear_forward(x, w, None, s, 0), linear_forward(x, w, None, s, 0))
    assert not same(
        linear_forward(x, w, None, s, 0),
        linear_forward(x, w, None, RoundCtx("stochastic", 0, 2), 0),
    )
    assert same(
        linear_forward(x, w, None, RoundCtx("nearest", 0, 1), 0),
        linear_forward(x, w, None, RoundCtx("nearest", 0, 9), 0),
    )
