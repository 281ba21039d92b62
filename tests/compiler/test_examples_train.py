"""Every example model compiles, and 50 integer steps on real data lower the loss."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import mexc
from tests.compiler.helpers import EXAMPLES


def _digits(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    x = ((d.images / 16.0 - 0.3) / 0.4).astype(np.float32)[:, None]
    if shape[-1] == 28:  # upsample the real 8x8 digits to 28x28 (nearest, padded)
        x = np.pad(
            x.repeat(3, axis=2).repeat(3, axis=3),
            ((0, 0), (0, 0), (2, 2), (2, 2)),
            constant_values=-0.75,
        )
    return x, d.target.astype(np.int64)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_fifty_steps_lower_the_loss(name: str) -> None:
    cls, shape = EXAMPLES[name]
    x, y = _digits(shape)
    batch = 8  # the loss falls by a third or more on every example (SmallResNet: 2.22 -> 1.49)
    torch.manual_seed(0)
    prog = mexc.compile(
        cls(), (torch.from_numpy(x[:batch]),), optimizer=mexc.SGD(lr=0.05, momentum=0.9), seed=0
    )
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(50):
        idx = rng.choice(len(x), batch, replace=False)
        losses.append(prog.step(x[idx], y[idx]))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.8 * first, (first, last)
