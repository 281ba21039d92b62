"""Shared weights: a parameter read by several ops (a block applied in a loop, a layer called
twice, one bias table gathered by two attention maps) gets the aligned sum of its readers'
accumulators (param_grad_sum, docs/numerics.md §7c). Against torch's gradients, and bit-exact
on reference, llvm, C and the CUDA source."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.ir import Op
from mexc.mx import Acc, RoundCtx
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


class Shared(nn.Module):
    """A residual block applied `repeats` times, a linear layer called as a module and through
    F.linear with its weight, and one bias table read through two index maps."""

    def __init__(self, repeats: int = 3) -> None:
        super().__init__()
        self.repeats = repeats
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 16)
        self.table = nn.Parameter(torch.randn(7) / 2)
        self.register_buffer("near", torch.tensor([[0, 1, 2, 3], [1, 0, 1, 2]]))
        self.register_buffer("far", torch.tensor([[6, 5, 4, 3], [5, 6, 5, 4]]))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for _ in range(self.repeats):
            x = x + F.relu(self.block(x))
        h = x.mean((2, 3))
        z = F.relu(self.fc(h)) + F.relu(F.linear(h, self.fc.weight))  # [B, 16]
        z = z.view(-1, 2, 8)[..., :4] + self.table[self.near]  # [B, 2, 4]
        w = z * self.table[self.far]
        return self.head(torch.cat([w, z], -1).flatten(1))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, batch)


def _program(target: str = "reference", batch: int = 4, repeats: int = 3) -> mexc.Program:
    torch.manual_seed(0)
    model = Shared(repeats)
    return mexc.compile(model, (torch.zeros(batch, 1, 8, 8),), target=target)


def test_each_shared_parameter_gets_one_sum_of_its_readers() -> None:
    prog = _program()
    sums = prog.graph.nodes_of(Op.PARAM_GRAD_SUM)
    # block.weight and block.bias (3 readers), fc.weight (2), table (2): each reader's
    # accumulator added to the sum of the ones before
    assert [len(n.inputs) for n in sums] == [2] * 6
    # a block applied 14 times: 13 sums for each of its two parameters
    deep = _program(repeats=14).graph.nodes_of(Op.PARAM_GRAD_SUM)
    assert [len(n.inputs) for n in deep] == [2] * 28


@pytest.mark.parametrize("repeats", [3, 14])
def test_shared_gradients_follow_autograd(repeats: int) -> None:
    torch.manual_seed(0)
    model = Shared(repeats)
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    x, y = _data(32)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("block.weight", "block.bias", "fc.weight", "table"), 0.98
    )


def test_the_sum_is_the_aligned_sum_of_the_spec() -> None:
    """docs/numerics.md §7c's example: each term bounded by its largest magnitude."""
    ctx = RoundCtx("nearest", 0, 0, 8)
    a = Acc(np.array([1000, -7, 2**30], np.int64), np.array(-20))  # b = 31
    b = Acc(np.array([3, 120, -5], np.int64), np.array(-10))  # b = 7
    got = K.param_grad_sum([a, b], ctx, 0)
    # max(-20, max(-20 + 31, -10 + 7) + c - 31) = -18, c = bit_length(2) = 2: a shifted right
    # by 2 (-7 / 4 = -1.75 -> -2), b left by 8
    assert int(got.e) == -18
    assert got.a.tolist() == [250 + 768, -2 + 30720, 2**28 - 1280]
    # with a's largest magnitude 1000 (b = 10) the sum is exact at a's exponent
    small = Acc(np.array([1000, -7, 5], np.int64), np.array(-20))
    got = K.param_grad_sum([small, b], ctx, 0)
    assert int(got.e) == -20 and got.a.tolist() == [1000 + 3072, -7 + 122880, 5 - 5120]


def test_an_all_zero_term_takes_no_part_in_the_sum() -> None:
    """A reader whose gradient is all zero carries an exponent but no bits: the sum of the
    others is what it would be without it, wherever its exponent is."""
    ctx = RoundCtx("stochastic", 3, 1, 8)
    a = Acc(np.array([1000, -7, 5], np.int64), np.array(-20))
    b = Acc(np.array([3, 120, -5], np.int64), np.array(-10))
    zero_above = Acc(np.zeros(3, np.int64), np.array(40))
    zero_below = Acc(np.zeros(3, np.int64), np.array(-90))
    alone = K.param_grad_sum([a, b], ctx, 0)
    for zero in (zero_above, zero_below):
        got = K.param_grad_sum([a, b, zero], ctx, 0)
        assert int(got.e) == int(alone.e) == -20
        assert got.a.tolist() == alone.a.tolist()
    nothing = K.param_grad_sum([zero_above, zero_below], ctx, 0)
    assert int(nothing.e) == -90 and not nothing.a.any()


def test_the_llvm_kernel_is_the_reference_sum() -> None:
    """te_ops.aligned_acc_sum on terms with spread exponents and magnitudes, zero terms among
    them, against kernels.param_grad_sum, stochastic rounding."""
    from mexc.kernels._common import site_key
    from mexc.lowering import te_ops
    from tests.compiler.helpers import run_kernel

    rng = np.random.default_rng(5)
    ctx = RoundCtx("stochastic", 11, 2, 8)
    shape = (6, 40)
    cases = [
        [(2**20, -30), (2**9, -12), (0, 50)],
        [(2**30, -5), (100, -40), (2**15, 0), (1, 3)],
        [(0, 7), (0, -3)],
        [(2**12, -20)] * 13,
    ]
    for case in cases:
        terms = [
            Acc(rng.integers(-top, top + 1, shape).astype(np.int64), np.array(e)) for top, e in case
        ]
        want = K.param_grad_sum(terms, ctx, 9)
        func = te_ops.aligned_acc_sum(shape, len(terms), True, "acc_sum")
        amax = [np.array([np.abs(t.a).max()], np.int32) for t in terms]
        keys = np.array([site_key(ctx, 9, i) for i in range(len(terms))], np.int64)
        target, acc = run_kernel(
            func,
            *(t.a.astype(np.int32) for t in terms),
            *(np.array([int(t.e)], np.int32) for t in terms),
            *amax,
            keys,
            outs=[((1,), "int32"), (shape, "int32")],
        )
        assert int(target[0]) == int(want.e), case
        np.testing.assert_array_equal(acc, want.a)


class Looped(nn.Module):
    """One linear layer applied 28 times: its bias's 28 accumulators hold 8 to 13 bits each."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(28):
            h = torch.tanh(self.fc(h))
        return self.head(h)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_looped_bias_keeps_its_gradient_s_bits(seed: int) -> None:
    """Bounded by the accumulator's width (31), each sum shifted a bias's few bits away:
    cosine 0.993 and 0.996 with autograd's for these seeds; bounded by each term's largest
    magnitude, 0.9998 and 0.9999."""
    torch.manual_seed(seed)
    model = Looped()
    prog = mexc.compile(model, (torch.zeros(32, 16),), seed=seed)
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 10, 32)
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(got["fc.bias"], want["fc.bias"]) >= 0.9995


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    x, y = _data(4)
    assert_trains_bit_exact_on_llvm_and_c(_program(), _program, (x, y))


@needs_cuda_tools
@pytest.mark.slow
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program(), tmp_path)


class Tied(nn.Module):
    """Two layers holding one weight tensor (b.weight = a.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.b(torch.relu(self.a(x.flatten(1)[:, :16]))))


def test_tied_weights_are_one_parameter_trained_as_torch_trains_it() -> None:
    torch.manual_seed(0)
    model = Tied()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),), rounding="nearest")
    names = [str(n.attrs.name) for n in prog.graph.nodes_of(Op.PARAM)]
    assert "a.weight" in names and "b.weight" not in names
    x, y = _data(32)
    assert_logits_match_torch(model, prog, x)
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(got["a.weight"], want["a.weight"]) >= 0.98  # both layers' gradients summed
    prog.step(x, y)
    again = prog.to_module(Tied())
    assert again.b.weight is again.a.weight
    assert np.array_equal(again.b.weight.detach().numpy(), prog.float_weights()["a.weight"])
