"""Writing into an activation (`x[...] = v`, MViTv2's `attn[:, :, 1:, 1:] = ...`) and in-place
ops (`x.add_(y)`, `torch.relu_(x)`): the written node is rebound to the new value (slices and
concatenations around a region). Against torch and autograd, bit-exact on reference, llvm and
C, and writes mexc cannot follow refused by node."""

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


class Writes(nn.Module):
    """A region rewritten from itself and another layer (MViTv2's form), a row set to a
    number, a column set from a parameter, and an integer index written with a broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(16, 16)
        self.col = nn.Parameter(torch.randn(8) / 2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8, 16]
        y = self.a(x)
        y[:, 1:, 4:12] = y[:, 1:, 4:12] * 0.5 + self.b(x)[:, 1:]
        y[:, 0] = 0.25
        z = self.c(x)
        z[..., 3] = self.col
        z[:, 2, :] = y.mean(1, keepdim=True)[:, 0]
        return self.head(torch.relu(y + z).mean(1))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 8, 16)).astype(np.float32), rng.integers(0, 10, batch)


def _program(target: str = "reference", batch: int = 4, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Writes(), (torch.zeros(batch, 8, 16),), target=target, **kw)


def test_writes_are_slices_and_concatenations() -> None:
    g = _program().graph
    ops = [n.op for n in g.nodes if g.is_forward(n) or n.op is Op.GATHER_PARAM]
    # y: 3 pieces on axis 1 and 3 on axis 2 for the region, 2 for row 0; z: 3 and 3
    assert ops.count(Op.CONCAT) == 5 and ops.count(Op.GATHER_PARAM) == 2


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = Writes()
    prog = mexc.compile(model, (torch.zeros(8, 8, 16),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


def test_the_written_and_overwritten_get_their_gradients() -> None:
    torch.manual_seed(0)
    model = Writes()
    prog = mexc.compile(model, (torch.zeros(32, 8, 16),))
    x, y = _data(32)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("a.weight", "b.weight", "c.weight", "col", "head.weight"), 0.98
    )


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    x, y = _data(4)
    assert_trains_bit_exact_on_llvm_and_c(_program(), lambda t: _program(t), (x, y))


class InPlace(nn.Module):
    """The in-place ops, the written tensor read afterwards by its old name."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8, 16]
        y = self.a(x)
        y.add_(self.b(x))
        y.mul_(0.5)
        y.clamp_(-1.5, 1.5)
        torch.relu_(y)
        return self.head(y.mean(1))


def test_in_place_ops_match_torch_and_train_bit_exact() -> None:
    torch.manual_seed(0)
    model = InPlace()
    prog = mexc.compile(model, (torch.zeros(8, 8, 16),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(InPlace(), (torch.zeros(4, 8, 16),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, _data(4))


class InPlaceLayers(nn.Module):
    """nn.ReLU(inplace=True) and F.hardtanh(..., True) (inplace by position) whose inputs are
    read again: torch changed them, so the later readers see the activations' results."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, u = self.a(x), self.b(x)
        z = self.act(y)
        F.hardtanh(u, -0.5, 0.5, True)
        return self.head((y - z + y + u).mean(1))  # relu(a(x)) + hardtanh(b(x))


class Aliased(InPlaceLayers):
    """One tensor under several names: in-place ops chained (their results are the tensor),
    changed through an in-place layer's result, by an underscored function and by augmented
    assignment; and a copy of disjoint elements of a tensor into itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.add_(0.5).mul_(2.0)  # y is 2 (y + 0.5)
        z = self.act(y)
        z.mul_(0.5)  # and y with it
        u = self.b(x)
        F.leaky_relu_(u, 0.1)
        sc = u
        u += y  # sc too
        u[:, :, 8:12] = u[:, :, 0:4]
        return self.head((y + u + sc).mean(1))


@pytest.mark.parametrize("make", [InPlaceLayers, Aliased])
def test_a_tensor_changed_under_one_name_is_changed_under_all(make: type[nn.Module]) -> None:
    """A layer called in place changes its input for later readers (InPlaceLayers), and
    every name of a changed tensor reads the change (Aliased)."""
    torch.manual_seed(0)
    model = make()
    prog = mexc.compile(model, (torch.zeros(8, 8, 16),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


class _InPlaceOnAView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[:, :4].mul_(3.0)
        return y[:, :10]


class _InPlaceOnAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :10] + self.p.mul_(2.0)[:10]


class _AfterIdentity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.same = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = self.same(y)
        y.mul_(2.0)
        return z[:, :10]


class _BoolKey(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[:, True] = 0.5
        return y[:, :10]


class _Overlapping(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[:, 1:5] = y[:, 0:4]
        return y[:, :10]


class _ShapeInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.unsqueeze_(1)
        return y.mean(1)[:, :10]


class _IntoAView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.view(x.shape[0], 2, 8)
        v[:, 0] = 0.0
        return x[:, :10]


class _ViewReadAfter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        t = y.transpose(0, 1)
        y[:, 3] = 1.0
        return t.transpose(0, 1)[:, :10]


class _IntoTheBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[0] = 1.0
        return y[:, :10]


class _Strided(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[:, ::2] = 1.0
        return y[:, :10]


class _IntoAParameter(_InPlaceOnAParameter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.p[0] = 1.0
        return (x + self.p)[:, :10]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_IntoAView, "shares memory with 'x', which 'getitem' reads"),
        (_ViewReadAfter, "shares memory with 'transpose'"),
        (_IntoTheBatch, "writes into part of the batch axis"),
        (_Strided, "writes through a strided slice"),
        (_IntoAParameter, "writes into a parameter"),
        (_InPlaceOnAView, "shares memory with 'mul', which 'getitem_1' reads"),
        (_InPlaceOnAParameter, "changes a parameter, a buffer or a constant in place"),
        (_AfterIdentity, "shares memory with 'same', which 'getitem' reads"),
        (_BoolKey, "not a tensor of indices, a boolean mask"),
        (_Overlapping, "overlap the written ones"),
        (_ShapeInPlace, "changes the shape of its input in place"),
    ],
)
def test_writes_mexc_cannot_follow_are_refused_by_node(make, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(make(), (torch.zeros(4, 16),))
    assert "node '" in str(err.value) and "test_item_assignment.py:" in str(err.value)
