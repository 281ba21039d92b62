"""The direct depthwise kernels give the exact integer convolution and input gradient (against
float64 PyTorch, exact for these magnitudes), at strides, paddings and kernel sizes the plan
meets, with mantissas at the ends of the int8 range."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm

from mexc.backends.llvm.products import host_cpu
from mexc.lowering import te_depthwise
from mexc.lowering.te_products import ConvGeom


def _run(func, *arrays: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    fn = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), host_cpu().target())
    out = tvm.runtime.tensor(np.zeros(out_shape, np.int32))
    fn["k"](*(tvm.runtime.tensor(a) for a in arrays), out)
    return out.numpy()


def _mantissas(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    v = rng.integers(-127, 128, shape).astype(np.int8)
    ends = [127, -127, -128, 127, -128]  # the products' extremes (2^14)
    v.reshape(-1)[: len(ends)] = ends[: v.size]
    return v


def _f64(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


# a 1x1 output of a 1x1 kernel: one element per plane, no loop inside the plane (bench/fuzz.py)
ONE_BY_ONE = [(2, 2, 1, 2, 0), (1, 1, 1, 1, 0), (1, 1, 1, 2, 0)]


@pytest.mark.parametrize(
    "h,w,k,stride,pad",
    [(9, 7, 3, 1, 1), (8, 8, 3, 2, 1), (6, 5, 5, 1, 2), (7, 9, 3, 1, 0), *ONE_BY_ONE],
)
def test_depthwise_convolution_is_exact(h: int, w: int, k: int, stride: int, pad: int) -> None:
    rng = np.random.default_rng(h * w + k)
    g = ConvGeom.of(3, 4, h, w, 4, k, k, stride, pad, 4)
    x, wt = _mantissas(rng, (3, 4, h, w)), _mantissas(rng, (4, 1, k, k))
    want = torch.nn.functional.conv2d(_f64(x), _f64(wt), stride=stride, padding=pad, groups=4)
    got = _run(te_depthwise.depthwise_acc(g, "dw"), x, wt, out_shape=g.y_shape)
    np.testing.assert_array_equal(got, want.numpy().astype(np.int64))


@pytest.mark.parametrize("h,w,k,pad", [(9, 7, 3, 1), (6, 5, 5, 2), (7, 9, 3, 0)])
def test_stride_one_input_gradient_is_the_flipped_convolution(h, w, k, pad) -> None:
    rng = np.random.default_rng(h + w + k)
    g = ConvGeom.of(2, 5, h, w, 5, k, k, 1, pad, 5)
    dy, wt = _mantissas(rng, (2, 5, g.oh, g.ow)), _mantissas(rng, (5, 1, k, k))
    assert te_depthwise.applies_to_input_gradient(g)
    func = te_depthwise.depthwise_acc(te_depthwise.flipped(g), "dx", flip=True)
    got = _run(func, dy, wt, out_shape=g.x_shape)
    want = torch.nn.grad.conv2d_input(g.x_shape, _f64(wt), _f64(dy), padding=pad, groups=5)
    np.testing.assert_array_equal(got, want.numpy().astype(np.int64))


@pytest.mark.parametrize(
    "h,w,k,stride,pad",
    [(9, 7, 3, 1, 1), (8, 8, 3, 2, 1), (6, 5, 5, 1, 2), (7, 9, 3, 2, 0), *ONE_BY_ONE],
)
def test_depthwise_weight_gradient_is_exact(h: int, w: int, k: int, stride: int, pad: int) -> None:
    rng = np.random.default_rng(h * w * k + stride)
    g = ConvGeom.of(3, 4, h, w, 4, k, k, stride, pad, 4)
    x, dy = _mantissas(rng, (3, 4, h, w)), _mantissas(rng, (3, 4, g.oh, g.ow))
    got = _run(te_depthwise.depthwise_weight_grad(g, "dw"), dy, x, out_shape=(4, 1, k, k))
    want = torch.nn.grad.conv2d_weight(
        _f64(x), (4, 1, k, k), _f64(dy), stride=stride, padding=pad, groups=4
    )
    np.testing.assert_array_equal(got, want.numpy().astype(np.int64))


def test_only_depthwise_geometries_are_taken() -> None:
    grouped = ConvGeom.of(1, 4, 5, 5, 8, 3, 3, 1, 1, 4)  # two outputs per group
    strided = ConvGeom.of(1, 4, 6, 6, 4, 3, 3, 2, 1, 4)
    assert not te_depthwise.applies(grouped)
    assert te_depthwise.applies(strided) and not te_depthwise.applies_to_input_gradient(strided)
    with pytest.raises(ValueError, match="not a depthwise"):
        te_depthwise.depthwise_acc(grouped, "x")
    with pytest.raises(ValueError, match="stride-1"):
        te_depthwise.flipped(strided)
    tall = ConvGeom.of(1, 4, 40, 6, 4, 3, 3, 1, 1, 4)  # 40 output rows: the GEMM path
    assert te_depthwise.applies(tall) and not te_depthwise.applies_to_weight_grad(tall)
    with pytest.raises(ValueError, match="no direct weight gradient"):
        te_depthwise.depthwise_weight_grad(tall, "x")
