"""A layer over a tensor the forward makes without its input (EdgeNeXt's and XCiT's Fourier
positional encodings, projected by a 1 x 1 convolution and added to the features): the
program holds the tensor as a constant and reads it as an activation. Against torch and
autograd, and bit-exact on reference, llvm and C."""

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
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
)


def fourier(batch: int, h: int, w: int) -> torch.Tensor:
    """A [batch, 4, h, w] encoding of the pixel coordinates."""
    ys = torch.arange(1, h + 1, dtype=torch.float32)[:, None].repeat(1, w) / h * 3
    xs = torch.arange(1, w + 1, dtype=torch.float32)[None, :].repeat(h, 1) / w * 3
    grid = torch.stack([ys.sin(), ys.cos(), xs.sin(), xs.cos()], 0)
    return grid[None].repeat(batch, 1, 1, 1)


class PosEncoded(nn.Module):
    """EdgeNeXt's form (the encoding made for the batch) and XCiT's (made for one sample,
    projected, then repeated over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.proj = nn.Conv2d(4, 8, 1)
        self.proj_one = nn.Conv2d(4, 8, 1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        y = self.stem(x) + self.proj(fourier(b, h, w).to(x.dtype))
        y = y + self.proj_one(fourier(1, h, w).to(x.dtype)).repeat(b, 1, 1, 1)
        return self.fc(torch.relu(y).mean((2, 3)))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 1, 6, 6)).astype(np.float32), rng.integers(0, 10, batch)


def _program(target: str = "reference", batch: int = 4, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(PosEncoded(), (torch.zeros(batch, 1, 6, 6),), target=target, **kw)


def test_the_encodings_are_constants_held_one_sample_each() -> None:
    prog = _program()
    gathers = [
        n for n in prog.graph.nodes_of(Op.GATHER_PARAM)
        if str(prog.graph.node(n.inputs[0].node).attrs.name).startswith("mexc.")
    ]  # fmt: skip
    assert len(gathers) == 2 and all(int(n.attrs.period) == 1 for n in gathers)
    held = [k for k in prog.state if k.startswith("mexc.")]
    assert len(held) == 2 and all(prog.state[k].m.shape == (1, 4, 6, 6) for k in held)
    assert not any(k.startswith("mexc.") and k.endswith("velocity") for k in prog.state)


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = PosEncoded()
    prog = mexc.compile(model, (torch.zeros(8, 1, 6, 6),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


def test_the_projections_get_their_gradients() -> None:
    torch.manual_seed(0)
    model = PosEncoded()
    prog = mexc.compile(model, (torch.zeros(32, 1, 6, 6),))
    x, y = _data(32)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("proj.weight", "proj_one.weight", "stem.weight"), 0.98
    )


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    x, y = _data(4)
    assert_trains_bit_exact_on_llvm_and_c(_program(), lambda t: _program(t), (x, y))


def test_data_parallel_refuses_the_encoding_made_for_one_sample_by_node() -> None:
    """The encoding made for the batch splits over workers like the batch; the one made for
    one sample and repeated has no rows to split, and shard-batch names it."""
    from mexc.pass_manager import PassContext
    from mexc.passes.shard_batch import shard_batch

    graph = _program().graph
    with pytest.raises(UnsupportedOpError, match="for one sample") as err:
        shard_batch(graph, PassContext(world=2))
    assert "test_constant_inputs.py:" in str(err.value)
