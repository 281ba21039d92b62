"""Cosine with autograd of the gradients of shared parameters (docs/numerics.md §7c), one step
on the reference at the program's dequantized weights, 4 seeds each:

    python bench/research/shared_grad_cosines.py

- `looped`: a linear layer applied 28 times, h = tanh(fc(h));
- `looped-res`: the same with residual ReLU blocks, h = h + relu(fc(h));
- `lstm`: a bidirectional LSTM (16 -> 32, 24 steps, batch 16), its steps' outputs averaged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mexc  # noqa: E402
from tests.compiler.helpers import cosine, float_gradients, integer_gradients  # noqa: E402


class Looped(nn.Module):
    def __init__(self, steps: int = 28, residual: bool = False) -> None:
        super().__init__()
        self.steps, self.residual = steps, residual
        self.inp = nn.Linear(16, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        for _ in range(self.steps):
            h = h + torch.relu(self.fc(h)) if self.residual else torch.tanh(self.fc(h))
        return self.head(h)


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0].mean(1))


def cosines(
    make: Callable[[], nn.Module], shape: tuple[int, ...], names: list[str]
) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {n: [] for n in names}
    for seed in range(4):
        torch.manual_seed(seed)
        model = make()
        prog = mexc.compile(model, (torch.zeros(*shape),), seed=seed)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(shape).astype(np.float32)
        y = rng.integers(0, 10, shape[0])
        got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
        for n in names:
            found[n].append(round(cosine(got[n], want[n]), 4))
    return found


if __name__ == "__main__":
    print("looped-res", cosines(lambda: Looped(residual=True), (32, 16), ["fc.weight", "fc.bias"]))
    print("looped", cosines(Looped, (32, 16), ["fc.weight", "fc.bias"]))
    hidden = ["rnn.weight_hh_l0", "rnn.weight_hh_l0_reverse", "rnn.bias_hh_l0"]
    print("lstm", cosines(Lstm, (16, 24, 16), [*hidden, "rnn.bias_hh_l0_reverse"]))
