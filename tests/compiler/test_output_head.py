"""The output head with many classes: a 1000-class head near uniform at initialization trains
(its probabilities are 15-bit, docs/layers.md "Output head"; with 8 bits every one rounded to 0
and no gradient flowed), its gradients are autograd's, and it trains bit-exact on reference,
llvm and C and from its CUDA source."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    small_batch,
)
from tests.compiler.test_hardswish import needs_cuda_tools

CLASSES = 1000
SHAPE = (16, 3, 8, 8)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _batch() -> tuple[np.ndarray, np.ndarray]:
    x, _ = small_batch(SHAPE)
    return x, np.random.default_rng(1).integers(0, CLASSES, SHAPE[0])


def _program(target: str = "reference") -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Wide(), (torch.zeros(*SHAPE),), target=target)


def test_a_thousand_classes_follow_autograd_and_the_loss_falls() -> None:
    torch.manual_seed(0)
    model = Wide()
    prog = mexc.compile(model, (torch.zeros(*SHAPE),))
    x, y = _batch()
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    for name in ("fc.weight", "conv.weight"):
        assert cosine(got[name], want[name]) >= 0.98, (name, cosine(got[name], want[name]))
        ratio = np.linalg.norm(got[name]) / np.linalg.norm(want[name])
        assert abs(ratio - 1) < 0.05, (name, ratio)
    losses = [prog.step(x, y) for _ in range(10)]
    assert abs(losses[0] - np.log(CLASSES)) < 0.1 and losses[-1] < losses[0] - 0.3


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(_program(), _program, _batch())


def test_a_head_of_2_to_the_16_classes_is_refused() -> None:
    """Its row sums of exp values (2^15 each) would pass int32: refused before any pass."""
    with pytest.raises(UnsupportedOpError, match="65536 classes; mexc's integer loss head"):
        mexc.compile(nn.Linear(4, 1 << 16), (torch.zeros(2, 4),))


@needs_cuda_tools
@pytest.mark.slow
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    """The head's row maximum over 1000 int8 logits runs one row per thread on the GPU (a
    block-shared int8 reduction read stale rows in the emulator from 64 classes on)."""
    assert_cuda_source_trains_bit_exact(_program(), tmp_path)
