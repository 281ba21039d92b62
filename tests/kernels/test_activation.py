import numpy as np
from kernel_helpers import rand_mx

from mexc.kernels import relu6_backward, relu6_cap, relu6_forward, relu_backward, relu_forward
from mexc.mx import MX


def test_relu() -> None:
    rng = np.random.default_rng(0)
    x, dy = rand_mx(rng, (4, 5), -3), rand_mx(rng, (4, 5), -9)
    y = relu_forward(x)
    assert int(y.e) == -3 and np.array_equal(y.m, np.maximum(x.m, 0))
    dx = relu_backward(dy, x)
    assert np.array_equal(dx.m, np.where(x.m > 0, dy.m, 0)) and int(dx.e) == -9
    assert np.array_equal(relu_backward(dy, y).m, dx.m)
    assert np.array_equal(relu_backward(dy, x.m > 0).m, dx.m)


def test_relu6_cap() -> None:
    assert relu6_cap(-5) == 127  # 6 * 32 = 192 > 127: plain ReLU
    assert relu6_cap(-4) == 96
    assert relu6_cap(0) == 6 and relu6_cap(1) == 3 and relu6_cap(2) == 1 and relu6_cap(3) == 0


def test_relu6_matches_float() -> None:
    rng = np.random.default_rng(1)
    for e in [-6, -4, -2, 0, 1]:
        x = rand_mx(rng, (200,), e)
        dy = rand_mx(rng, (200,), -9)
        xf = x.dequantize()
        y = relu6_forward(x)
        # exact where the clip value 6 is representable at exponent e
        if e <= 1:
            assert np.allclose(y.dequantize(), np.clip(xf, 0, 6))
        dx = relu6_backward(dy, x)
        assert np.array_equal(dx.m, np.where((xf > 0) & (xf < 6), dy.m, 0))
    big = MX.of(np.array([127, 1, -1]), 3)  # 1016, 8, -8
    assert list(relu6_forward(big).m) == [0, 0, 0]
