"""A 0-dim parameter (a learnable scalar: `self.scale * h`) is one velocity group of one entry on
every backend, as in the reference (numerics.row_count). The llvm and C plans used to index its
shape's first axis and fail to build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc


class ScaledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.fc(x)


def _program(target: str, adamw: bool, bits: int) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.AdamW(lr=0.1) if adamw else mexc.SGD(lr=0.1, momentum=0.9)
    return mexc.compile(
        ScaledHead(), (torch.zeros(8, 16),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("target", ["llvm", "c"])
@pytest.mark.parametrize(("adamw", "bits"), [(False, 8), (True, 6)])
def test_a_scalar_parameter_trains_bit_exact(target: str, adamw: bool, bits: int) -> None:
    prog, ref = _program(target, adamw, bits), _program("reference", adamw, bits)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    for step in range(3):
        # the C step reports the loss in milli-nats
        assert prog.step(x, y) == pytest.approx(ref.step(x, y), abs=5e-4), step
        assert prog.state_checksum() == ref.state_checksum(), step
    assert prog.float_weights()["scale"] == ref.float_weights()["scale"] != 1.5
