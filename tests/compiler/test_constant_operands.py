"""Constant tensors and parameters subtracted and divided: input normalization with buffers,
`(x - self.mean) / self.std` and `(self.mean - x) / self.std` (the constant negated or inverted
on the host, then added or multiplied), and a parameter subtracted either way (p - x as -x + p,
x - p as -(-x + p)): the ops gather_param, add, mul, scale and add_param, which other tests
train on every target. Against torch and autograd, and a divisor holding a zero refused by
node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_logits_match_torch,
    cosine,
    dequantized_copy,
    float_gradients,
    integer_gradients,
    small_batch,
)

SHAPE = (8, 3, 8, 8)


class Normalized(nn.Module):
    """ImageNet-style input normalization by buffers, a convolution, a learned shift subtracted
    from the features and the features subtracted from another."""

    def __init__(self, flipped: bool = False) -> None:
        super().__init__()
        self.flipped = flipped
        self.register_buffer("mean", torch.tensor([0.5, -0.2, 0.1]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.25, 0.5, 2.0]).view(3, 1, 1))
        self.conv = nn.Conv2d(3, 8, 3)
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, 8).view(8, 1, 1))
        self.offset = nn.Parameter(torch.linspace(0.1, -0.1, 8).view(8, 1, 1))
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (self.mean - x) / self.std if self.flipped else (x - self.mean) / self.std
        h = torch.relu(self.conv(x)) - self.shift
        return self.fc((self.offset - h).mean((2, 3)))


def _program(target: str = "reference", flipped: bool = False, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Normalized(flipped), (torch.zeros(*SHAPE),), target=target, **kw)


def test_constants_are_folded_and_parameters_added() -> None:
    ops = [n.op for n in _program().graph.nodes]
    # the input's two constants as gathered ones: -mean added, 1 / std multiplied
    assert ops.count(Op.GATHER_PARAM) == 2
    assert ops.index(Op.GATHER_PARAM) < ops.index(Op.ADD) < ops.index(Op.MUL)
    assert ops.count(Op.ADD_PARAM) == 2  # the shift and the offset, each added to -h


@pytest.mark.parametrize("flipped", [False, True])
def test_logits_and_gradients_match_torch(flipped: bool) -> None:
    torch.manual_seed(0)
    model = Normalized(flipped)
    prog = mexc.compile(model, (torch.zeros(*SHAPE),), rounding="nearest")
    x, y = small_batch(SHAPE)
    # the same model with mean 0 and std 1 is as far (0.031 and 0.091 of the largest logit)
    assert_logits_match_torch(model, prog, x, rel=0.1)
    want_logits = dequantized_copy(model, prog).eval()(torch.from_numpy(x).double())
    assert cosine(prog.logits(x).ravel(), want_logits.detach().numpy().ravel()) >= 0.995
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    for name in ("shift", "offset", "conv.weight", "fc.weight"):
        assert cosine(got[name], want[name]) >= 0.98, (name, cosine(got[name], want[name]))
    assert cosine(got["shift"], -want["offset"]) < 1  # two gradients, not one negated twice


def test_a_divisor_holding_zero_is_refused_by_node() -> None:
    class ZeroStd(Normalized):
        def __init__(self) -> None:
            super().__init__()
            self.std[1] = 0.0

    with pytest.raises(UnsupportedOpError, match=r"'truediv'.*constant tensor holding zeros"):
        mexc.compile(ZeroStd(), (torch.zeros(*SHAPE),))


def test_a_0_dim_parameter_trains_and_goes_back_to_the_module() -> None:
    """A learned temperature nn.Parameter(torch.tensor(2.0)): its gradient is autograd's, and
    to_module copies it back (a scalar, which float_weights returns as a 0-dim array)."""

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(12, 10)
            self.temperature = nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1)) * self.temperature

    torch.manual_seed(0)
    model = Tempered()
    prog = mexc.compile(model, (torch.zeros(8, 3, 2, 2),))
    x, y = small_batch((8, 3, 2, 2))
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert got["temperature"].shape == () and cosine(got["temperature"], want["temperature"]) == 1
    prog.step(x, y)
    back = prog.to_module(Tempered())
    assert back.temperature.item() == float(prog.float_weights()["temperature"]) != 2.0


def test_a_divisor_of_integers_made_in_forward_is_a_constant() -> None:
    """x / (self.counts + 1) with an integer buffer: the reciprocals of a constant."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(12, 8)
            self.fc = nn.Linear(8, 10)
            self.register_buffer("counts", torch.arange(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.fc1(x.flatten(1)) / (self.counts + 1))

    torch.manual_seed(0)
    model = Counted()
    prog = mexc.compile(model, (torch.zeros(8, 3, 2, 2),), rounding="nearest")
    assert [n.op for n in prog.graph.nodes].count(Op.GATHER_PARAM) == 1
    assert_logits_match_torch(model, prog, small_batch((8, 3, 2, 2))[0], rel=0.03)
