"""Worst-case mantissas through the Fashion-MNIST CNN layers with int32 overflow checks on."""

import numpy as np
import pytest
from kernel_helpers import worst_mx

from mexc import kernels as K
from mexc.kernels._common import int_matmul
from mexc.mx import MX, RoundCtx
from mexc.numerics import OverflowDebugError, matmul_exact, overflow_debug


def test_fashion_cnn_worst_case_no_overflow() -> None:
    rng = np.random.default_rng(0)
    ctx = RoundCtx("stochastic", 0, 1)
    n = 128
    x = worst_mx(rng, (n, 1, 28, 28), -7)
    w1, w2 = worst_mx(rng, (16, 1, 3, 3), -7), worst_mx(rng, (32, 16, 3, 3), -8)
    g1, g2 = MX.of(np.full(16, 127), -7), MX.of(np.full(32, -127), -7)
    b1, b2 = worst_mx(rng, (16,), -7), worst_mx(rng, (32,), -7)
    wl, bl = worst_mx(rng, (10, 32 * 7 * 7), -9), worst_mx(rng, (10,), -7)
    labels = rng.integers(0, 10, n)
    with overflow_debug():
        c1 = K.conv2d_forward(x, w1, None, 1, 1, 1, ctx, 0)
        n1, s1 = K.batchnorm_forward_train(c1, g1, b1, 1e-5, ctx, 16)
        r1 = K.relu_forward(n1)
        p1, a1 = K.maxpool2d_forward(r1, 2)
        c2 = K.conv2d_forward(p1, w2, None, 1, 1, 1, ctx, 32)
        n2, s2 = K.batchnorm_forward_train(c2, g2, b2, 1e-5, ctx, 48)
        r2 = K.relu_forward(n2)
        p2, a2 = K.maxpool2d_forward(r2, 2)
        f = MX(p2.m.reshape(n, -1), p2.e)
        lo = K.linear_forward(f, wl, bl, ctx, 64)
        probs, _ = K.softmax_ce_forward(lo, labels, n, ctx, 80)
        dlo = K.softmax_ce_backward(probs, labels, n, ctx, 96)
        K.linear_backward_weight(dlo, f)
        K.bias_backward(dlo, (0,))
        df = K.linear_backward_input(dlo, wl, ctx, 112)
        dr2 = K.maxpool2d_backward(
            MX(df.m.reshape(p2.shape), df.e), a2, r2.shape, 2, None, 0, ctx, 128
        )
        dc2, _, _ = K.batchnorm_backward(K.relu_backward(dr2, r2), s2, ctx, 144)
        K.conv2d_backward_weight(dc2, p1, w2.shape, 1, 1, 1)
        dp1 = K.conv2d_backward_input(dc2, w2, p1.shape, 1, 1, 1, ctx, 160)
        dr1 = K.maxpool2d_backward(dp1, a1, r1.shape, 2, None, 0, ctx, 176)
        dc1, _, _ = K.batchnorm_backward(K.relu_backward(dr1, r1), s1, ctx, 192)
        K.conv2d_backward_weight(dc1, x, w1.shape, 1, 1, 1)
        # worst-case gradients straight into the backward kernels too
        wd = worst_mx(rng, dc1.shape, -9)
        K.batchnorm_backward(wd, s1, ctx, 192)
        K.conv2d_backward_weight(wd, x, w1.shape, 1, 1, 1)
        K.conv2d_backward_input(worst_mx(rng, dc2.shape, -9), w2, p1.shape, 1, 1, 1, ctx, 160)


def test_worst_case_bn_constant_and_saturated_channels() -> None:
    ctx = RoundCtx("nearest")
    x = MX.of(np.where(np.arange(128 * 4 * 9).reshape(128, 4, 3, 3) % 2, 127, -127), -3)
    g, b = MX.of(np.full(4, 127), 0), MX.of(np.full(4, -127), 0)
    with overflow_debug():
        y, s = K.batchnorm_forward_train(x, g, b, 0.0, ctx, 0)
        K.batchnorm_backward(MX.of(np.full(x.shape, -127), 0), s, ctx, 16)
        const = MX.of(np.full((8, 4), 127), 0)
        K.batchnorm_forward_train(const, g, b, 0.0, ctx, 0)


def test_oversized_product_raises() -> None:
    a = np.full((1, 200_000), 127)
    b = np.full((200_000, 1), 127)
    with overflow_debug(), pytest.raises(OverflowDebugError):
        matmul_exact(a, b)
    with overflow_debug(), pytest.raises(OverflowDebugError):
        int_matmul(a, b)


def test_negative_cap_preshifts() -> None:
    """K = 2^18 makes product_cap(K, 8) negative: the kernel pre-shifts x and stays in int32."""
    rng = np.random.default_rng(2)
    ctx = RoundCtx("stochastic", 0, 1)
    k = 1 << 18
    x, w = worst_mx(rng, (2, k), -7), MX.of(np.full((3, k), 127), -7)
    with overflow_debug():
        y = K.linear_forward(MX.of(np.full((2, k), 127), -7), w, None, ctx, 0)
        K.linear_forward(x, w, None, ctx, 0)
    assert np.allclose(y.dequantize(), 127 * 127 * k * 2.0**-14, rtol=0.02)
