"""F.normalize (p = 2) along a non-batch axis and RMSNorm (nn.RMSNorm, F.rms_norm, timm's
RmsNorm) as a LayerNorm of [x, -x] (mexc.ops.norm), and torch.abs as two ReLUs: cosine attention,
a cosine classifier and RMS-normalized blocks against torch's values and gradients, a row of
zeros, and bit-exact training on reference, llvm and C."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
)


class Cosine(nn.Module):
    """Channels normalized (dim 1 of a feature map), cosine attention (SwinV2's q and k
    normalized along the features) and a cosine classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.q = nn.Linear(8, 16)
        self.fc = nn.Linear(16, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 6, 6)
        y = F.normalize(F.relu(self.conv(x)), dim=1)
        t = self.q(y.flatten(2).transpose(1, 2))  # (B, 36, 16)
        u = F.normalize(t, dim=-1)
        h = ((u @ u.transpose(-1, -2)).softmax(-1) @ t).mean(1)
        return self.fc(F.normalize(h, p=2.0, dim=-1)) * 10


class RmsBlocks(nn.Module):
    """nn.RMSNorm with its weight, timm's RmsNorm, F.rms_norm with a parameter, and |x|."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(36, 32)
        self.n1 = nn.RMSNorm(32)
        self.n2 = timm.layers.norm.RmsNorm(32, eps=1e-6)
        self.w = nn.Parameter(1 + torch.randn(32) / 4)
        self.fc = nn.Linear(32, 10)
        with torch.no_grad():
            self.n1.weight.add_(torch.randn(32) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 6, 6)
        y = self.n2(F.gelu(self.n1(self.a(x.flatten(1)))))
        return self.fc(F.rms_norm(y, (32,), self.w, 1e-5).abs())


MODELS = {"cosine": Cosine, "rms": RmsBlocks}


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 1, 6, 6)).astype(np.float32), rng.integers(0, 10, batch)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_torch(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    prog = mexc.compile(model, (torch.zeros(8, 1, 6, 6),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


@pytest.mark.parametrize(
    ("model_name", "name"),
    [
        ("cosine", "conv.weight"),
        ("cosine", "q.weight"),
        ("cosine", "fc.weight"),
        ("rms", "a.weight"),
        ("rms", "n1.weight"),
        ("rms", "w"),
    ],
)
def test_gradients_follow_autograd(model_name: str, name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[model_name]()
    prog = mexc.compile(model, (torch.zeros(32, 1, 6, 6),))
    x, y = _data(32)
    got = integer_gradients(prog, x, y)[name]
    want = float_gradients(model, prog, x, y)[name]
    assert cosine(got, want) >= 0.97, cosine(got, want)


def test_a_row_of_zeros_stays_zero() -> None:
    """torch's F.normalize of zeros is zeros (its eps floor); so is the LayerNorm's."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.normalize(self.fc(F.relu(x)), dim=1) + 1.0

    x = -np.abs(np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32))
    prog = mexc.compile(Head(), (torch.from_numpy(x),), rounding="nearest")
    assert np.array_equal(prog.logits(x), np.ones((4, 8)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_bit_exact_on_reference_llvm_and_c(name: str) -> None:
    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(MODELS[name](), (torch.zeros(4, 1, 6, 6),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, _data(4))


def test_abs_is_two_relus_and_exact() -> None:
    class Abs(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.abs(x)

    x = np.random.default_rng(2).standard_normal((4, 10)).astype(np.float32)
    prog = mexc.compile(Abs(), (torch.from_numpy(x),))
    assert [n.op for n in prog.graph.nodes].count(Op.RELU) == 2
    xq = mexc.kernels.quantize(x.astype(np.float64), 8).dequantize()
    assert np.array_equal(prog.logits(x), np.abs(xq))


def test_other_norms_are_refused_by_node() -> None:
    class L1(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.normalize(x, p=1.0, dim=1)

    with pytest.raises(mexc.UnsupportedOpError, match="node 'normalize'.*p=1.0"):
        mexc.compile(L1(), (torch.zeros(4, 10),))
