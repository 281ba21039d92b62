"""2-norms of activations (`x.norm(dim=..., keepdim=...)`, `torch.norm`,
`torch.linalg.vector_norm`) as sum(x * x / |x|), and an activation divided by its own norm
(`f / f.norm(dim=1, keepdim=True).clamp(min=eps)`, a cosine classifier) as F.normalize.
Against torch and autograd, bit-exact on reference, llvm and C, other divisions refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
)


class Norms(nn.Module):
    """A spatial norm per channel as a gate (global response normalization's first half), a
    feature's norm kept as a feature, and a cosine classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(17, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, 6, 6]
        y = torch.relu(self.conv(x))
        g = torch.linalg.vector_norm(y, 2, (2, 3), True)  # [B, 8, 1, 1]
        f = self.fc((y * g).mean((2, 3)))  # [B, 16]
        length = torch.norm(f, dim=1, keepdim=True)  # [B, 1]
        unit = f / f.norm(dim=1, keepdim=True).clamp(min=1e-6)
        return self.head(torch.cat([unit, length / 4], 1))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 1, 6, 6)).astype(np.float32), rng.integers(0, 10, batch)


def _program(target: str = "reference", batch: int = 4, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Norms(), (torch.zeros(batch, 1, 6, 6),), target=target, **kw)


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = Norms()
    prog = mexc.compile(model, (torch.zeros(8, 1, 6, 6),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


def test_gradients_follow_autograd() -> None:
    torch.manual_seed(0)
    model = Norms()
    prog = mexc.compile(model, (torch.zeros(32, 1, 6, 6),))
    x, y = _data(32)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("conv.weight", "fc.weight", "head.weight"), 0.97
    )


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    x, y = _data(4)
    assert_trains_bit_exact_on_llvm_and_c(_program(), lambda t: _program(t), (x, y))


class _Ratio(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :10] / (x[:, 10:] + 2.0)


class _OtherNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :10] / x.norm(p=1, dim=1, keepdim=True)


class _BatchNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :10] * x.norm(dim=0, keepdim=True)[:, :10]


class _AcrossTheBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.permute(1, 0), dim=1).permute(1, 0)[:, :10]


class _NumberOverNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :10] * (1.0 / x.norm(dim=1, keepdim=True))


class _ChangedAfterItsNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        n = y.norm(dim=1, keepdim=True)
        y.mul_(2.0)
        return (y / n)[:, :10]


class _Spectral(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.reshape(-1, 4, 5)
        return (m / torch.linalg.norm(m, 2, (1, 2), True)).reshape(-1, 20)[:, :10]


class _WideFloor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x / (x.norm(dim=1, keepdim=True) + 0.5))[:, :10]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_NumberOverNorm, "divides the number 1.0 by a tensor"),
        (_AcrossTheBatch, "takes a norm along the batch axis"),
        (_WideFloor, "floors a 2-norm at 0.5"),
        (_OtherNorm, "with p=1"),
        (_BatchNorm, "along the batch axis"),
        (_Spectral, "matrix norm ord=2"),
    ],
)
def test_other_divisions_and_norms_are_refused_by_node(make, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(make(), (torch.zeros(4, 20),))
    assert "node '" in str(err.value) and "test_vector_norm.py:" in str(err.value)


@pytest.mark.parametrize("make", [_Ratio, _ChangedAfterItsNorm])
def test_a_ratio_and_a_norm_taken_before_a_change_are_quotients(make: type) -> None:
    """Divisions by another tensor, or by a norm of x taken before x changed in place, are
    `div`s of the values torch divides (test_division.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Linear(10, 10))
    prog = mexc.compile(model, (torch.zeros(8, 20),), target="reference", rounding="nearest")
    assert [n.op for n in prog.graph.nodes].count(Op.DIV) == 1
    x = np.random.default_rng(0).standard_normal((8, 20)).astype(np.float32) * 0.5
    assert_logits_match_torch(model, prog, x)


class _LinalgNorms(nn.Module):
    """torch.linalg.norm: a vector norm over one axis (ord None or 2), the Frobenius norm of
    a matrix over two (ord None or "fro")."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(20, 20)
        self.head = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        m = h.reshape(-1, 4, 5)
        frob = m / torch.linalg.norm(m, dim=(1, 2), keepdim=True)
        fro = m / torch.linalg.norm(m, "fro", (1, 2), True).clamp(min=1e-6)
        unit = h / torch.linalg.norm(h, 2, -1, keepdim=True)
        length = torch.linalg.norm(h, dim=-1)[:, None]
        return self.head((frob + fro).reshape(-1, 20) + unit * length)


def test_linalg_norms_match_torch_and_autograd() -> None:
    torch.manual_seed(0)
    model = _LinalgNorms()
    prog = mexc.compile(model, (torch.zeros(16, 20),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((16, 20)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, 16)
    assert_logits_match_torch(model, prog, x)
    assert_gradients_follow_autograd(model, prog, x, y, ("fc.weight", "head.weight"), 0.97)
