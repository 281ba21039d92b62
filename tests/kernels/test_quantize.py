import numpy as np
import pytest

from mexc.kernels import quantize


def test_quantize_exponent_and_rounding() -> None:
    x = np.array([1.0, -0.5, 0.25, 0.0])
    q = quantize(x, 8)
    assert int(q.e) == -6  # 127 * 2^-7 < 1 <= 127 * 2^-6
    assert list(q.m) == [64, -32, 16, 0]
    assert int(quantize(np.array([127.0]), 8).e) == 0
    assert int(quantize(np.array([127.5]), 8).e) == 1
    assert list(quantize(np.array([127.0, 2.5, -2.5]), 8).m) == [127, 3, -3]  # half away


def test_quantize_roundtrip_and_zero() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000)
    q = quantize(x, 8)
    assert np.max(np.abs(q.dequantize() - x)) <= 2.0 ** float(q.e) / 2 + 1e-12
    assert np.abs(q.m).max() <= 127
    z = quantize(np.zeros(3))
    assert int(z.e) == 0 and not z.m.any()


def test_quantize_rejects_nan() -> None:
    with pytest.raises(ValueError):
        quantize(np.array([1.0, np.nan]))
    with pytest.raises(ValueError):
        quantize(np.array([np.inf]))
