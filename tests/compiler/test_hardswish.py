"""Hardswish, the op added through the registry (docs/adding-an-op.md): its integer form
(docs/layers.md) against torch's float Hardswish, and a model with it trained bit-exact on every
backend: reference, llvm, C, and the CUDA artifact's own source on the CPU emulator."""

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
MANTISSAS = np.arange(-128, 128).astype(np.int8)
# units of the result's exponent: the final rounding (0.5) plus the 15-bit compaction before the
# division by 6, div_const's nearest quotient and the 2^-16 grid of x (measured: at most 0.006)
TOLERANCE = 0.51


def _float(v: MX) -> np.ndarray:
    return v.m.astype(np.float64) * 2.0 ** float(v.e)


@pytest.mark.parametrize("e", [-20, -9, -5, -3, -1, 0, 1, 2, 5])
def test_forward_is_torch_hardswish_rounded_once(e: int) -> None:
    x = MX.of(MANTISSAS, e)
    y = K.hardswish_forward(x, NEAREST, 0)
    want = F.hardswish(torch.from_numpy(_float(x))).numpy()
    assert np.abs(_float(y) - want).max() <= TOLERANCE * 2.0 ** float(y.e)
    assert np.abs(y.m.astype(int)).max() >= 64  # the result uses the int8 range


@pytest.mark.parametrize("e", [-20, -7, -5, -2, 0, 1, 3])
def test_backward_is_torch_gradient_rounded_once(e: int) -> None:
    x = MX.of(MANTISSAS, e)
    rng = np.random.default_rng(e + 100)
    dy = MX.of(rng.integers(-127, 128, MANTISSAS.shape).astype(np.int8), -6)
    dx = K.hardswish_backward(dy, x, NEAREST, 0)
    xt = torch.from_numpy(_float(x)).requires_grad_()
    F.hardswish(xt).backward(torch.from_numpy(_float(dy)))
    assert xt.grad is not None
    assert np.abs(_float(dx) - xt.grad.numpy()).max() <= TOLERANCE * 2.0 ** float(dx.e)


def test_gradient_breakpoints_follow_torch() -> None:
    """g = 0 at x = -3, (2x + 3) / 6 = -0.5 just above, 1 at x = 3, 1.5 just below."""
    x = MX.of(np.array([-48, -47, 47, 48], np.int8), -4)  # -3, -2.9375, 2.9375, 3
    dy = MX.of(np.full(4, 96, np.int8), -5)  # 3.0
    got = _float(K.hardswish_backward(dy, x, NEAREST, 0))
    xt = torch.from_numpy(_float(x)).requires_grad_()
    F.hardswish(xt).backward(torch.full((4,), 3.0, dtype=torch.float64))
    assert xt.grad is not None
    np.testing.assert_allclose(got, xt.grad.numpy(), atol=2**-3)
    assert got[0] == 0.0 and got[3] == 3.0


def test_registry_defines_hardswish_on_every_backend() -> None:
    for op in (Op.HARDSWISH, Op.HARDSWISH_GRAD):
        d = REGISTRY[op]
        assert all(d.supports(b) for b in ("reference", "llvm", "cuda", "c")), op
        assert d.lowering("c") is not None


class HardswishNet(nn.Module):
    """Hardswish as a module and as a function, after a conv and after batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.act = nn.Hardswish()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))
        x = F.max_pool2d(F.hardswish(self.bn(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def _program(target: str) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(HardswishNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target)


def test_model_trains_bit_exact_on_reference_llvm_and_c() -> None:
    ref = _program("reference")
    assert {Op.HARDSWISH, Op.HARDSWISH_GRAD} <= {n.op for n in ref.graph.nodes}
    want = train_checksums(ref)
    assert len(set(want)) == 3  # the state changes every step
    assert train_checksums(_program("llvm")) == want
    assert train_checksums(_program("c")) == want


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)
