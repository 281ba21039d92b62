"""Softshrink (x - clamp(x, -lambd, lambd)), LogSigmoid (-softplus(-x)) and Softmin (the
softmax of -x): decompositions into clamp, scale, add, the softplus offset table and softmax.
Against torch and autograd, and bit-exact on reference, llvm and C."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    small_batch,
)


class Shrinks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.shrink = nn.Softshrink(0.25)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 16)
        self.softmin = nn.Softmin(dim=-1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.softshrink(self.shrink(self.fc1(x)), 0.125)
        h = F.logsigmoid(self.fc2(h))
        return self.head(self.softmin(self.fc3(h)) + F.softmin(h[:, :16], dim=1))


def _model() -> Shrinks:
    torch.manual_seed(0)
    return Shrinks()


def test_each_is_its_decomposition() -> None:
    prog = mexc.compile(_model(), (torch.zeros(4, 16),), target="reference")
    ops = [n.op for n in prog.graph.nodes]
    assert ops.count(Op.CLAMP) == 2 and ops.count(Op.ACTIVATION_OFFSET) == 1
    assert ops.count(Op.SOFTMAX) == 2


def test_logits_match_torch() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(16, 16),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((16, 16))[0])


def test_gradients_follow_autograd() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(64, 16),))
    x, y = small_batch((64, 16))
    assert_gradients_follow_autograd(
        model, prog, x, y, ("fc1.weight", "fc2.weight", "fc3.weight", "head.weight"), 0.95
    )


def test_trains_bit_exact_on_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        return mexc.compile(_model(), (torch.zeros(4, 16),), target=target)

    batch = small_batch((4, 16))
    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, batch)


class Thresholded(nn.Module):
    """nn.Threshold(0.1, -0.5) and F.threshold(x, -0.2, 0.0): x where x > t, else the value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.threshold = nn.Threshold(0.1, -0.5)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.threshold(self.fc1(x)))
        return self.head(F.threshold(h, -0.2, 0.0))


def test_thresholds_are_masks_and_match_torch() -> None:
    torch.manual_seed(0)
    model = Thresholded()
    prog = mexc.compile(model, (torch.zeros(64, 16),), rounding="nearest")
    assert [n.op for n in prog.graph.nodes].count(Op.DIV) == 2  # one mask each
    x, y = small_batch((64, 16))
    # entries within the int8 rounding of a threshold fall either way: 0.071 of the largest
    assert_logits_match_torch(model, prog, x, rel=0.1)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("fc1.weight", "fc2.weight", "head.weight"), 0.97
    )
