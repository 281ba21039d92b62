"""clamp and Hardtanh (docs/layers.md): the bounds at the input's exponent, exact against
fractions; the result and the gradient mask against torch's (0 at the bounds themselves, for
clamp as for Hardtanh); and a model with every form trained bit-exact on every backend: reference,
llvm, C, and the CUDA artifact's own source on the CPU emulator."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.ir import Op
from mexc.kernels.activation import bound_mantissa
from mexc.mx import MX
from tests.compiler.helpers import assert_cuda_source_trains_bit_exact, train_checksums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

MANTISSAS = np.arange(-128, 128).astype(np.int8)


@pytest.mark.parametrize("v", [0.0, 1.0, -1.0, 6.0, 0.5, -2.5, 0.1, -0.3, 1000.0, 3e-5])
@pytest.mark.parametrize("e", [-30, -12, -7, -3, 0, 2, 9, 25])
def test_bound_mantissa_is_floor_and_ceil_of_the_bound(v: float, e: int) -> None:
    """Exact against the bound's own value num 2^-shift over 2^e, up to the saturation past
    every int8 mantissa."""
    num, shift = K.clamp_bound(v)
    exact = Fraction(num) * Fraction(2) ** (-shift - e)
    for ceil, want in ((False, math.floor(exact)), (True, math.ceil(exact))):
        got = bound_mantissa((num, shift), e, ceil)
        if abs(want) < 2**16:
            assert got == want, (ceil, got, want)
        else:  # saturated, with the sign, beyond any mantissa
            assert abs(got) >= 2**16 and (got > 0) == (want > 0)


def _float(v: MX) -> torch.Tensor:
    return torch.from_numpy(np.asarray(v.m).astype(np.float64) * 2.0 ** float(v.e))


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 6.0), (-1.0, 1.0), (-0.5, None), (None, 2.0)])
@pytest.mark.parametrize("e", [-6, -3, 0])
def test_clamp_and_hardtanh_are_torchs(lo: float | None, hi: float | None, e: int) -> None:
    """The result is torch's with the bounds rounded inward to the grid of x (lo up, hi down:
    exact where they are on it; -0.5 at exponent 0 becomes 0); the gradients of torch.clamp and
    F.hardtanh are torch's exactly, at the bounds themselves too (0 there)."""
    x = MX.of(MANTISSAS, e)
    attrs = SimpleNamespace(
        lo=lo or 0.0, hi=hi or 0.0, has_lo=lo is not None, has_hi=hi is not None
    )
    bounds = K.clamp_bounds(attrs)
    y = K.clamp_forward(x, *bounds, 127)
    dy = MX.of(np.full(256, 64, np.int8), -6)
    dx = K.clamp_backward(dy, x, *bounds)
    grid_lo = None if lo is None else math.ceil(lo * 2.0**-e) * 2.0**e
    grid_hi = None if hi is None else math.floor(hi * 2.0**-e) * 2.0**e
    want = torch.clamp(_float(x), grid_lo, grid_hi)
    np.testing.assert_array_equal(_float(y).numpy(), want.numpy())
    forms = [lambda t: torch.clamp(t, lo, hi)]
    if lo is not None and hi is not None:
        forms.append(lambda t: F.hardtanh(t, lo, hi))
    for form in forms:
        xt = _float(x).requires_grad_()
        form(xt).backward(_float(dy))
        assert xt.grad is not None
        np.testing.assert_array_equal(_float(dx), xt.grad)


def test_a_bound_past_the_mantissas_saturates() -> None:
    """clamp(min=5) of x below 2^-2: 5 is past 127 2^-5, so every element is the largest
    mantissa (the result stays within the activation's bits)."""
    x = MX.of(np.array([-3, 0, 7], np.int8), -5)
    y = K.clamp_forward(x, K.clamp_bound(5.0), None, 127)
    assert (y.m == 127).all() and y.e == -5


class ClampNet(nn.Module):
    """Every form: clamp(min=0) as a method, torch.clamp with both bounds, Hardtanh as a
    module and a function, torch.clip with max only, clamp_min."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.act = nn.Hardtanh(-2.0, 2.0)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x).clamp(min=0))
        x = F.max_pool2d(torch.clamp(self.conv2(x), -1.0, 1.5), 2)
        x = torch.clip(F.hardtanh(x, -0.75, 1.0), max=0.5).clamp_min(-0.25)
        return self.fc(torch.flatten(x, 1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        ClampNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    clamps = [n for n in ref.graph.nodes if n.op is Op.CLAMP]
    assert len(clamps) == 6
    want = train_checksums(ref)
    assert len(set(want)) == 3
    assert train_checksums(_program("llvm", bits)) == want
    assert train_checksums(_program("c", bits)) == want


class _TensorBound(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, min=x * 0.5)


def test_bounds_that_are_not_numbers_are_refused() -> None:
    model = nn.Sequential(nn.Flatten(), _TensorBound(), nn.Linear(4, 3))
    with pytest.raises(mexc.UnsupportedOpError, match="clamps to a tensor"):
        mexc.compile(model, (torch.zeros(2, 1, 2, 2),))
    model = nn.Sequential(nn.Flatten(), nn.Hardtanh(-1e6, 1e6), nn.Linear(4, 3))
    with pytest.raises(mexc.UnsupportedOpError, match="below 2\\^15"):
        mexc.compile(model, (torch.zeros(2, 1, 2, 2),))


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)
