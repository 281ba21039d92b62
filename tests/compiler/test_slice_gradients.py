"""The gradient of a value read by slices along one axis (an LSTM's steps of its input
projection, chunks, a token's pieces): adjacent disjoint slices' gradients concatenated into one
tensor (docs/layers.md, "Gradient sums"), not each slice's gradient placed into a whole tensor of
zeros and summed. Structure, memory linear in the sequence, gradients against autograd, and
bit-exact on reference, llvm, C and the CUDA source."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_gradients_follow_autograd,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    train_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


class Pieces(nn.Module):
    """A projection read by slices of its last axis: [0, 4) and [4, 8) adjacent, [10, 12)
    apart, [2, 6) overlapping both; [8, 10) unread."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)
        self.head = nn.Linear(4 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # [N, 3, 12]
        a, b = h[..., 0:4], torch.relu(h[..., 4:8])
        c, d = h[..., 10:12].repeat(1, 1, 2), torch.tanh(h[..., 2:6])
        return self.head(torch.cat([a, b * 2, c, d, a * b], -1).mean(1))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 3, 8)).astype(np.float32), rng.integers(0, 10, batch)


def _pieces(target: str = "reference", batch: int = 4) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Pieces(), (torch.zeros(batch, 3, 8),), target=target)


def _backward(prog: mexc.Program) -> list:
    """The nodes derive-backward added (from the loss's gradient on)."""
    (seed,) = prog.graph.nodes_of(Op.SOFTMAX_CE_GRAD)
    return [n for n in prog.graph.nodes if n.id >= seed.id]


def test_adjacent_slices_have_one_concatenated_gradient() -> None:
    prog = _pieces()
    back = _backward(prog)
    joins = [n for n in back if n.op is Op.CONCAT]
    assert len(joins) == 1 and int(joins[0].attrs.dim) == 2
    assert joins[0].type.shape == (4, 3, 8)  # [0, 4) and [4, 8)
    padded = [n for n in back if n.op is Op.SLICE_GRAD]
    # the join placed into [0, 12), [10, 12) and the overlapping [2, 6) each into zeros
    assert sorted((n.attrs.start, n.attrs.stop) for n in padded) == [(0, 8), (2, 6), (10, 12)]
    (total,) = [n for n in back if n.op is Op.GRAD_SUM and n.type.shape == (4, 3, 12)]
    assert set(total.inputs) == {n.out for n in padded}


def test_gradients_follow_autograd() -> None:
    torch.manual_seed(0)
    model = Pieces()
    prog = mexc.compile(model, (torch.zeros(64, 3, 8),))
    x, y = _data(64)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("proj.weight", "proj.bias", "head.weight"), 0.98
    )


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(_pieces(), _pieces, _data(4))


class SumSliced(nn.Module):
    """h = a + b (or a + a) read by [0, 4), a also by [4, 8): the add hands one gradient to
    both its inputs (to a twice), and a's slices join."""

    def __init__(self, same: bool) -> None:
        super().__init__()
        self.same = same
        self.l1, self.l2, self.head = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l1(x)
        h = a + (a if self.same else self.l2(x))
        return self.head(torch.cat([h[:, 0:4], torch.relu(a[:, 4:8])], 1))


@pytest.mark.parametrize("same", [False, True])
def test_a_gradient_an_add_hands_on_is_joined_and_kept(same: bool) -> None:
    """The joined slice gradient was removed though b's gradient is the same value (a step
    then read an undefined input), and with a + a both copies were dropped (cosine 0.95)."""
    x, y = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32), np.arange(64) % 10
    torch.manual_seed(0)
    model = SumSliced(same)
    prog = mexc.compile(model, (torch.zeros(64, 6),))
    assert_gradients_follow_autograd(
        model, prog, x, y, ("l1.weight", "l1.bias", "head.weight"), 0.995
    )

    def small(target: str = "reference") -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(SumSliced(same), (torch.zeros(4, 6),), target=target)

    assert train_checksums(small(), (x[:4], y[:4])) == train_checksums(
        small("llvm"), (x[:4], y[:4])
    )


class Unbound(nn.Module):
    """timm's attention: q, k and v unbound along the first axis of the permuted projection
    (3, N, heads, T, D), whose batch axis is the second."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 3 * 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v  # (N, 2, T, 4)
        return self.head(att.transpose(1, 2).reshape(n, t, 8).mean(1))


def test_q_k_and_v_unbound_along_the_first_axis_have_one_gradient() -> None:
    torch.manual_seed(0)
    prog = mexc.compile(Unbound(), (torch.zeros(4, 3, 8),))
    (join,) = [n for n in _backward(prog) if n.op is Op.CONCAT]
    assert int(join.attrs.dim) == 0 and join.type.shape == (3, 4, 2, 3, 4)
    assert not prog.graph.nodes_of(Op.SLICE_GRAD)
    torch.manual_seed(0)
    model = Unbound()
    prog = mexc.compile(model, (torch.zeros(64, 3, 8),))
    x, y = _data(64)
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(got["qkv.weight"], want["qkv.weight"]) >= 0.97


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


def _lstm(steps: int, batch: int = 4, target: str = "reference") -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Lstm(), (torch.zeros(batch, steps, 8),), target=target)


def test_an_lstm_sums_no_whole_tensor_per_step() -> None:
    back = _backward(_lstm(16))
    # the input projection [N, T, 4H] gets the steps' gradients as one concat (and each
    # step's gates their four pieces as one): no gradient the size of the projection is summed
    assert not [n for n in back if n.op is Op.GRAD_SUM and n.type.shape == (4, 16, 64)]
    assert [len(n.inputs) for n in back if n.op is Op.CONCAT].count(16) == 1
    # the hidden weight's 15 accumulators (the first step reads the bias alone), each added
    # to the sum of the ones before as soon as it exists: never more than two live
    sums = [n for n in back if n.op is Op.PARAM_GRAD_SUM and n.type.shape == (64, 16)]
    readers = [n.id for n in back if n.op is Op.LINEAR_GRAD_WEIGHT and n.type.shape == (64, 16)]
    assert len(readers) == 15 and [len(n.inputs) for n in sums] == [2] * 14
    assert all(r < s.id < later for r, s, later in zip(readers[1:], sums, readers[2:]))


def test_an_lstm_s_training_memory_grows_linearly_with_its_sequence() -> None:
    """Summing each step's slice gradient, a whole [N, T, 4H] tensor, held T of them (T² bytes),
    and every step's weight accumulator lived until the end: the arena grew 11.1x from 8 steps
    to 32 (110,484 to 1,226,772 bytes). Now it grows as the sequence does, less (3.7x:
    35,540 to 130,132 bytes)."""
    short, long = (_lstm(t, batch=16).memory_report()["planned_arena_bytes"] for t in (8, 32))
    assert long / short <= 4.0, (short, long)


def test_an_lstm_trains_bit_exact_on_reference_llvm_and_c() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 15, 8)).astype(np.float32), rng.integers(0, 10, 2)
    assert_trains_bit_exact_on_llvm_and_c(_lstm(15, 2), lambda target: _lstm(15, 2, target), (x, y))


@needs_cuda_tools
@pytest.mark.slow
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_lstm(15, 2), tmp_path)
