"""An activation indexed with a list of integers beside slices (CSATv2's
`x[:, :, self.permutation]`): the runs of consecutive entries sliced and concatenated, exact
copies in torch's order, repeated entries included; their gradients sum back (the slices'
gradients joined into one tensor). Against torch, and bit-exact on reference, llvm and C."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_trains_bit_exact_on_llvm_and_c,
    small_batch,
    step_values,
)


class Listed(nn.Module):
    """Channels permuted with a repeat, then the last axis read in a new order after `...`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(5 * 8 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)[:, [2, 0, 1, 3, 3]]  # [N, 5, 8, 8]
        x = x[..., [5, 4, -1]]  # [N, 5, 8, 3]
        return self.fc(x.flatten(1))


def _program(target: str = "reference", batch: int = 4) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Listed(), (torch.zeros(batch, 1, 8, 8),), target=target)


def test_the_entries_are_torchs_in_its_order() -> None:
    prog = _program()
    x, y = small_batch()
    values = step_values(prog, x, y)
    (conv,) = [n for n in prog.graph.nodes if n.op is Op.CONV2D_COMPACT]
    (fc,) = prog.graph.nodes_of(Op.LINEAR_COMPACT)
    src = values[conv.out]
    want = src.m[:, [2, 0, 1, 3, 3]][..., [5, 4, -1]].reshape(4, -1)
    got = values[fc.inputs[0]]
    np.testing.assert_array_equal(got.m.reshape(4, -1), want)
    assert int(got.e) == int(src.e)


def test_gradients_follow_autograd() -> None:
    torch.manual_seed(0)
    model = Listed()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((32, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 32)
    assert_gradients_follow_autograd(model, prog, x, y, ("conv.weight", "fc.weight"), 0.99)


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(_program(), _program, small_batch())


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (lambda x: x[[0, 1]], "batch axis"),
        (lambda x: x[:, [0, 1], 2], "indexes an activation with"),
    ],
)
def test_other_list_keys_are_refused(key: object, why: str) -> None:
    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.fc = nn.LazyLinear(10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(key(self.conv(x)).flatten(1))  # type: ignore[operator]

    model = Keyed()
    with pytest.raises(UnsupportedOpError, match=why):
        model(torch.zeros(4, 1, 8, 8))  # the lazy head
        mexc.compile(model, (torch.zeros(4, 1, 8, 8),))
