import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import cos, rand_mx, same, tt

from mexc.kernels import conv2d_backward_input, conv2d_backward_weight, conv2d_forward
from mexc.mx import RoundCtx


@pytest.mark.parametrize(
    "groups,cin,cout,stride,pad",
    [(1, 8, 16, 1, 1), (1, 8, 16, 2, 0), (2, 8, 16, 2, 1), (8, 8, 8, 1, 1), (8, 8, 16, 2, 1)],
)
def test_conv_matches_torch(groups: int, cin: int, cout: int, stride: int, pad: int) -> None:
    rng = np.random.default_rng(cin + cout + stride + pad + groups)
    ctx = RoundCtx("stochastic", seed=1, step=2)
    x = rand_mx(rng, (8, cin, 8, 8), -5)
    w = rand_mx(rng, (cout, cin // groups, 3, 3), -7)
    b = rand_mx(rng, (cout,), -6)
    y = conv2d_forward(x, w, b, stride, pad, groups, ctx, 0)
    xt, wt, bt = tt(x, True), tt(w, True), tt(b, True)
    yt = F.conv2d(xt, wt, bt, stride, pad, 1, groups)
    assert y.shape == tuple(yt.shape)
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, y.shape, -9)
    yt.backward(tt(dy))
    dx = conv2d_backward_input(dy, w, x.shape, stride, pad, groups, ctx, 16)
    dw = conv2d_backward_weight(dy, x, w.shape, stride, pad, groups)
    assert cos(dx.dequantize(), xt.grad) >= 0.99
    assert np.allclose(dw.dequantize(), wt.grad.numpy())  # exact: un-compacted int32
    assert dx.m.dtype == np.int8 and dx.e.ndim == 0


def test_conv_deterministic_and_rounding_modes() -> None:
    rng = np.random.default_rng(0)
    x = rand_mx(rng, (4, 4, 6, 6), -5)
    w = rand_mx(rng, (8, 4, 3, 3), -7)
    s1, s2 = RoundCtx("stochastic", 0, 1), RoundCtx("stochastic", 0, 2)
    n1, n2 = RoundCtx("nearest", 0, 1), RoundCtx("nearest", 0, 2)
    a = conv2d_forward(x, w, None, 1, 1, 1, s1, 0)
    assert same(a, conv2d_forward(x, w, None, 1, 1, 1, s1, 0))
    assert not same(a, conv2d_forward(x, w, None, 1, 1, 1, s2, 0))
    assert same(
        conv2d_forward(x, w, None, 1, 1, 1, n1, 0), conv2d_forward(x, w, None, 1, 1, 1, n2, 0)
    )
    d = rand_mx(rng, a.shape, -9)
    g1 = conv2d_backward_input(d, w, x.shape, 1, 1, 1, s1, 3)
    assert same(g1, conv2d_backward_input(d, w, x.shape, 1, 1, 1, s1, 3))
    assert not same(g1, conv2d_backward_input(d, w, x.shape, 1, 1, 1, s2, 3))


def test_conv_torch_dtype_sanity() -> None:
    assert torch.get_default_dtype() in (torch.float32, torch.float64)
