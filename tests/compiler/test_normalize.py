"""F.normalize (p = 2) along a non-batch axis as a LayerNorm of [x, -x] (mexc.ops.norm):
cosine attention and a cosine classifier against torch's values and gradients, a row of zeros,
and bit-exact training on reference, llvm and C."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
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


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 1, 6, 6)).astype(np.float32), rng.integers(0, 10, batch)


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = Cosine()
    prog = mexc.compile(model, (torch.zeros(8, 1, 6, 6),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


@pytest.mark.parametrize("name", ["conv.weight", "q.weight", "fc.weight"])
def test_gradients_follow_autograd(name: str) -> None:
    torch.manual_seed(0)
    model = Cosine()
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


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(Cosine(), (torch.zeros(4, 1, 6, 6),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, _data(4))


def test_other_norms_are_refused_by_node() -> None:
    class L1(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.normalize(x, p=1.0, dim=1)

    with pytest.raises(mexc.UnsupportedOpError, match="node 'normalize'.*p=1.0"):
        mexc.compile(L1(), (torch.zeros(4, 10),))
