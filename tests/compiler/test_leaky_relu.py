"""LeakyReLU (docs/layers.md): its slope as a host constant, its integer form against torch's
float op in both directions, and a model with it (module and function, a positive and a
negative slope) trained bit-exact on every backend: reference, llvm, C, and the CUDA
artifact's own source on the CPU emulator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.ir import Op
from mexc.mx import MX, RoundCtx
from mexc.ops import REGISTRY
from tests.compiler.helpers import assert_cuda_source_trains_bit_exact, train_checksums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

NEAREST = RoundCtx("nearest", 0, 0, 8)
MANTISSAS = np.arange(-127, 128).astype(np.int8)
SLOPES = [0.01, 0.1, 0.2, 1 / 3, 1.0, 0.0, -0.25, 1.5]


def _float(v: MX) -> np.ndarray:
    return v.m.astype(np.float64) * 2.0 ** float(v.e)


def test_slope_is_a_numerator_and_a_shift() -> None:
    assert K.leaky_slope(0.01) == (20972, 21)  # 0.01 2^21 = 20971.52, 15 bits
    assert K.leaky_slope(0.5) == (16384, 15)
    assert K.leaky_slope(-0.25) == (-16384, 16)
    assert K.leaky_slope(0.0) == (0, 0)
    assert K.leaky_slope(3e-6) == (25, 23)  # the shift is capped: 3e-6 2^23 = 25.2
    assert K.leaky_slope(1e-8) == (0, 23)  # below 2^-24: 0
    for bad in (2.0**15, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="slope"):
            K.leaky_slope(bad)


@pytest.mark.parametrize("slope", SLOPES)
@pytest.mark.parametrize("e", [-9, -4, 0, 3])
def test_forward_is_torch_rounded_once(slope: float, e: int) -> None:
    x = MX.of(MANTISSAS, e)
    y = K.leaky_relu_forward(x, slope, NEAREST, 0)
    want = F.leaky_relu(torch.from_numpy(_float(x)), slope).numpy()
    assert np.abs(_float(y) - want).max() <= 0.5 * 2.0 ** float(y.e)
    if 0 <= slope <= 1:  # positive inputs pass exactly
        assert y.e == e and (y.m[MANTISSAS > 0] == MANTISSAS[MANTISSAS > 0]).all()


@pytest.mark.parametrize("slope", SLOPES)
def test_backward_is_torch_gradient_rounded_once(slope: float) -> None:
    x = MX.of(MANTISSAS, -4)
    rng = np.random.default_rng(7)
    dy = MX.of(rng.integers(-127, 128, MANTISSAS.shape).astype(np.int8), -6)
    saved = K.leaky_relu_forward(x, slope, NEAREST, 0) if slope >= 0 else x
    dx = K.leaky_relu_backward(dy, saved, slope, NEAREST, 1)
    xt = torch.from_numpy(_float(x)).requires_grad_()
    F.leaky_relu(xt, slope).backward(torch.from_numpy(_float(dy)))
    assert xt.grad is not None
    assert np.abs(_float(dx) - xt.grad.numpy()).max() <= 0.5 * 2.0 ** float(dx.e)


def test_the_backward_saves_the_output_unless_the_slope_is_negative() -> None:
    for slope, saved_op in ((0.1, Op.LEAKY_RELU), (-0.1, Op.CONV2D_COMPACT)):
        act = nn.LeakyReLU(slope)
        model = nn.Sequential(nn.Conv2d(1, 2, 3), act, nn.Flatten(), nn.Linear(8, 3))
        g = mexc.compile(model, (torch.zeros(2, 1, 4, 4),), target="reference").graph
        grad = next(n for n in g.nodes if n.op is Op.LEAKY_RELU_GRAD)
        assert g.node(grad.inputs[1].node).op is saved_op


def test_a_slope_out_of_range_names_the_node() -> None:
    model = nn.Sequential(nn.Flatten(), nn.LeakyReLU(1e6), nn.Linear(4, 3))
    want = r"node '_1'.* LeakyReLU with slope 1000000.0; .*below 2\^15"
    with pytest.raises(mexc.UnsupportedOpError, match=want):
        mexc.compile(model, (torch.zeros(2, 1, 2, 2),))


def test_registry_defines_leaky_relu_on_every_backend() -> None:
    for op in (Op.LEAKY_RELU, Op.LEAKY_RELU_GRAD):
        assert all(REGISTRY[op].supports(b) for b in ("reference", "llvm", "cuda", "c")), op


class LeakyNet(nn.Module):
    """LeakyReLU as a module (in place, after batch norm) and as a function with a negative
    slope, before and after a max pool (CSPDarknet's and a GAN discriminator's pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.LeakyReLU(0.1, inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.act(self.bn(self.conv1(x))), 2)
        x = F.leaky_relu(self.conv2(x), negative_slope=-0.2)
        return self.fc(torch.flatten(x, 1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        LeakyNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    """B = 4 with channel exponents too (on by default below 8 bits)."""
    ref = _program("reference", bits)
    assert {Op.LEAKY_RELU, Op.LEAKY_RELU_GRAD} <= {n.op for n in ref.graph.nodes}
    want = train_checksums(ref)
    assert len(set(want)) == 3  # the state changes every step
    assert train_checksums(_program("llvm", bits)) == want
    assert train_checksums(_program("c", bits)) == want


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)
