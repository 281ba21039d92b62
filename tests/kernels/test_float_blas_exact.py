"""The reference's float-BLAS products are exact emulations of the integer sums
(docs/numerics.md §5): float32 only while every partial sum is below 2^24, float64 below 2^53,
exact int64 otherwise; in debug mode operands outside the static bound take the int64 path."""

from __future__ import annotations

import numpy as np
import pytest

from mexc.kernels import _common as C
from mexc.kernels import conv
from mexc.numerics import overflow_debug


def _exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(np.asarray(a, np.int64), np.asarray(b, np.int64))


def _odd_worst_row(k: int) -> tuple[np.ndarray, np.ndarray]:
    """A K-wide row whose sum is odd and as large as int8 operands allow (-128 included):
    K - 1 products (-128)(-128) = 2^14 and one 127 * 127 (odd)."""
    a = np.full((1, k), -128, np.int64)
    b = np.full((k, 1), -128, np.int64)
    a[0, 0] = b[0, 0] = 127
    return a, b


@pytest.mark.parametrize("k", [1, 9, 1023, 1024, 1040, 1041, 4096, 70_000])
def test_worst_case_int8_rows_are_exact(k: int) -> None:
    a, b = _odd_worst_row(k)
    want = (k - 1) * 2**14 + 127 * 127
    assert int(C.int_matmul(a, b)[0, 0]) == want
    rng = np.random.default_rng(k)
    a2 = rng.choice(np.array([-128, -127, 127]), (7, k))
    b2 = rng.choice(np.array([-128, 127]), (k, 5))
    assert np.array_equal(C.int_matmul(a2, b2), _exact(a2, b2))


def test_float32_path_ends_where_float32_stops_being_exact() -> None:
    """K = 1040 passed 127^2 * K < 2^24 (the bound before -128 was counted), but an int8 row
    with a -128 reaches 2^24 there: float32 rounds its odd sum; int_matmul (K * 128^2 >= 2^24,
    float64) does not."""
    a, b = _odd_worst_row(1040)
    want = 1039 * 2**14 + 127 * 127
    assert want > 2**24 and want % 2 == 1  # not a binary32 value
    as_f32 = np.matmul(a.astype(np.float32), b.astype(np.float32))
    assert int(as_f32[0, 0]) != want
    assert int(C.int_matmul(a, b)[0, 0]) == want
    assert 1023 * 128**2 < C.F32_EXACT <= 1024 * 128**2  # float32 for K <= 1023 only


def test_bounds_beyond_float64_take_the_int64_path() -> None:
    """Operands declared up to 2^30: K * amax * bmax >= 2^53, so no float path; 2^60 + 1 would
    be 2^60 in float64."""
    a = np.array([[2**30, 1]], np.int64)
    b = np.array([[2**30], [1]], np.int64)
    assert float(np.matmul(a.astype(np.float64), b.astype(np.float64))[0, 0]) == 2.0**60
    assert int(C.int_matmul(a, b, amax=2**30, bmax=2**30)[0, 0]) == 2**60 + 1


def test_debug_mode_checks_the_static_bound_and_falls_back() -> None:
    """Operands outside the default int8 bound (a caller's error): float32 would round
    2^24 + 1; in debug mode int_matmul sees the bound fail and computes in int64."""
    a = np.array([[2**24 + 1, 2]], np.int64)
    b = np.array([[1], [1]], np.int64)
    assert int(np.matmul(a.astype(np.float32), b.astype(np.float32))[0, 0]) == 2**24 + 2
    with overflow_debug():
        assert int(C.int_matmul(a, b)[0, 0]) == 2**24 + 3


@pytest.mark.parametrize("c,fast", [(1023, True), (1024, False)])
def test_conv_float32_fast_path_bound(c: int, fast: bool) -> None:
    """The stride-1 convolution's float32 GEMM is taken only for K = C*KH*KW <= 1023, and is
    exact at the bound with worst-case int8 values."""
    x = np.full((1, c, 2, 2), -128, np.int8)
    w = np.full((2, c, 1, 1), -128, np.int8)
    x[0, 0], w[:, 0] = 127, 127
    got = conv._conv_s1_f32(x, w, 0, 0)
    if not fast:
        assert got is None
        return
    assert got is not None
    want = (c - 1) * 2**14 + 127 * 127
    assert np.array_equal(got, np.full((1, 2, 2, 2), want, np.int32))


def test_conv_weight_gradient_gemm_is_exact_and_guarded() -> None:
    rng = np.random.default_rng(3)
    x = rng.choice(np.array([-128, -127, 127], np.int8), (16, 3, 10, 10))
    d = rng.choice(np.array([-128, 127], np.int8), (16, 4, 10, 10))  # T = 1600: chunks of 800
    got = conv._grad_weight_gemm(x, d, 3, 3, 1, 1)
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.zeros((4, 3, 3, 3), np.int64)
    for i in range(3):
        for j in range(3):
            want[:, :, i, j] = np.einsum(
                "nohw,nchw->oc", d.astype(np.int64), xp[:, :, i : i + 10, j : j + 10]
            )
    assert np.array_equal(got, want.reshape(4, -1))
    # a reduction of 2^40 products is beyond float64's exact range (shapes only, no data)
    huge = np.broadcast_to(np.int8(1), (2**20, 1, 2**10, 2**10))
    with pytest.raises(ValueError, match="beyond float64"):
        conv._grad_weight_gemm(x, huge, 3, 3, 1, 1)
