import numpy as np
from kernel_helpers import cos, rand_mx, same

from mexc.kernels import add_forward, dropout_backward, dropout_forward, grad_sum
from mexc.mx import RoundCtx
from mexc.numerics import FixedScalar


def test_add_and_grad_sum() -> None:
    rng = np.random.default_rng(0)
    ctx = RoundCtx("stochastic", 0, 1)
    a, b, c = rand_mx(rng, (8, 8, 8), -5), rand_mx(rng, (8, 8, 8), -7), rand_mx(rng, (8, 8, 8), -2)
    y = add_forward(a, b, ctx, 0)
    assert cos(y.dequantize(), a.dequantize() + b.dequantize()) >= 0.999
    assert same(y, add_forward(a, b, ctx, 0))
    s = grad_sum([a, b, c], ctx, 0)
    assert cos(s.dequantize(), a.dequantize() + b.dequantize() + c.dequantize()) >= 0.999
    assert grad_sum([a], ctx, 0) is a


def test_dropout() -> None:
    rng = np.random.default_rng(1)
    ctx = RoundCtx("stochastic", 0, 1)
    x = rand_mx(rng, (64, 256), -5)
    p = FixedScalar.of(0.25)
    y, mask = dropout_forward(x, p, ctx, 0)
    assert abs(mask.mean() - 0.75) < 0.01
    want = np.where(mask, x.dequantize() / 0.75, 0)
    assert cos(y.dequantize(), want) >= 0.999
    y2, mask2 = dropout_forward(x, p, ctx, 0)
    assert same(y, y2) and np.array_equal(mask, mask2)
    _, mask3 = dropout_forward(x, p, RoundCtx("stochastic", 0, 2), 0)
    assert not np.array_equal(mask, mask3)
    dy = rand_mx(rng, x.shape, -9)
    dx = dropout_backward(dy, mask, p, ctx, 16)
    assert cos(dx.dequantize(), np.where(mask, dy.dequantize() / 0.75, 0)) >= 0.999
