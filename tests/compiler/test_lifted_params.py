"""Functions of parameters that an activation reads (EfficientViM's
`sigmoid(self.alpha).view(4, -1, 1, 1)[0] * (conv(x) - x)`, a gate `x * torch.tanh(self.g)`),
and parameters that torch.maximum takes with an activation (FilterResponseNorm's TLU): the
parameter repeated over the batch and the function applied per sample (mexc.frontend_lift).
Against torch's logits and autograd's gradients, and bit-exact on reference, llvm and C."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    small_batch,
)


class Gated(nn.Module):
    """EfficientViM's residual gates and its heads weighted by a softmax of a parameter and
    stacked, FilterResponseNorm's TLU (`torch.maximum(x, tau)`), a softplus scale, and a gate
    that is also read as a layer scale (one parameter, two readers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.alpha = nn.Parameter(torch.linspace(-2.0, 2.0, 4 * 8))
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.5, 8))
        self.heads = nn.ModuleList(nn.Linear(8, 10) for _ in range(3))
        self.weights = nn.Parameter(torch.tensor([0.5, -0.5, 1.0]))
        self.tau = nn.Parameter(torch.linspace(-0.5, 0.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.maximum(self.conv(x), self.tau.reshape(1, -1, 1, 1))
        alpha = torch.sigmoid(self.alpha).view(4, -1, 1, 1)
        x = x + alpha[0] * (torch.relu(x) - x)
        x = x + alpha[3].squeeze(-1).permute(1, 0).unsqueeze(-1) * x  # [1, 8, 1]: along H
        x.mul_(F.softplus(self.gate).view(-1, 1, 1))  # in place: a reader nothing reads
        x = x.mean((2, 3)) * self.gate
        x = x * torch.tanh(self.gate)
        weights = self.weights.softmax(-1)
        return torch.stack([weights[i] * head(x) for i, head in enumerate(self.heads)]).sum(0)


def _program(target: str = "reference", batch: int = 4) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Gated(), (torch.zeros(batch, 1, 8, 8),), target=target)


def test_each_function_runs_per_sample_on_the_parameter_repeated() -> None:
    prog = _program()
    expands = prog.graph.nodes_of(Op.EXPAND_PARAM)
    assert sorted(prog.graph.node(n.inputs[0].node).attrs.name for n in expands) == [
        "alpha",
        "gate",
        "tau",
        "weights",
    ]  # one copy per parameter, however many functions read it
    assert all(n.type.shape[0] == 4 for n in expands)


def test_logits_and_gradients_follow_torch() -> None:
    torch.manual_seed(0)
    model = Gated()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((32, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 32)
    assert_logits_match_torch(model, prog, x, rel=0.1)  # five int8 products deep: cosine 0.998
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    for name in ("alpha", "gate", "weights", "tau", "conv.weight", "heads.0.weight"):
        assert cosine(got[name], want[name]) >= 0.99, (name, cosine(got[name], want[name]))
    # alpha[1] and alpha[2] are read by nothing: no gradient, as in torch
    assert not got["alpha"][8:24].any() and not want["alpha"][8:24].any()


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(_program(), _program, small_batch())


def test_the_stacked_heads_hold_the_batch_on_axis_one() -> None:
    """torch.stack of the heads' logits along a new axis 0 holds the batch on axis 1; the sum
    over axis 0 is a mean with the batch moved first. A data-parallel worker refuses the
    concatenation by name: its rounding keys count elements of the whole tensor, and a
    worker's rows on axis 1 are not one block of it."""
    from mexc.distributed import Workers
    from mexc.targets import worker_program

    prog = _program(batch=8)
    stacked = [n.type.shape for n in prog.graph.nodes_of(Op.CONCAT) if n.attrs.dim == 0]
    assert stacked == [(3, 8, 10)]
    with pytest.raises(UnsupportedOpError, match=r"node %\d+ \(concat\) at test_lifted"):
        worker_program(prog, Workers(0, 2, None))  # type: ignore[arg-type]


class Forms(nn.Module):
    """Argument forms and orders: two functions of one parameter read in the reverse of the
    order they are made, a function read after torch.cat, keyword shapes and dims, a tuple of
    dims, and `.transpose().contiguous().view()` (a view that needs the copy, which the
    frontend drops before the lifted graph's shapes are propagated again)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.p = nn.Parameter(torch.linspace(-1.0, 1.0, 16))
        self.q = nn.Parameter(torch.linspace(0.5, -0.5, 8).reshape(1, 8, 1, 1))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.reshape(torch.sigmoid(self.p[:8]), shape=(-1, 1, 1))
        b = torch.tanh(self.q).squeeze((0, 3)).permute(dims=(1, 0)).unsqueeze(-1)  # [1, 8, 1]
        h = self.conv(x) * b  # b, made after a, is read first
        h = torch.cat([h * a, -h], 1)
        h = h * F.softplus(self.p).view(-1, 1, 1)  # read after the concatenation
        tokens = h.transpose(1, 3).contiguous().view(h.shape[0], -1, 16)  # [N, 64, 16]
        return self.fc(tokens.mean(1))


@pytest.mark.parametrize(("make", "batch"), [(Forms, 4), (Gated, 1)])
def test_argument_forms_and_a_batch_of_one_follow_torch(make: type, batch: int) -> None:
    torch.manual_seed(0)
    model = make()
    prog = mexc.compile(model, (torch.zeros(batch, 1, 8, 8),))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((batch, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x, rel=0.1)
    y = rng.integers(0, 10, batch)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("p", "q") if make is Forms else ("alpha", "tau", "weights"), 0.99
    )


class _Read(nn.Module):
    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.fc = nn.Linear(64, 10)
        self.p = nn.Parameter(torch.ones(64))
        self.register_buffer("b", torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if self.use == "linear":  # a function of a parameter as a layer's input
            return self.fc(torch.sigmoid(self.p).expand(x.shape[0], -1))
        if self.use == "buffer":  # a parameter and a buffer: not a function of parameters
            return self.fc(x * torch.sigmoid(self.p * self.b))
        return self.fc(x * torch.sigmoid(self.p).sum())  # a reduction: not per element


@pytest.mark.parametrize("use", ["linear", "buffer", "sum"])
def test_other_functions_of_parameters_are_refused_by_name(use: str) -> None:
    with pytest.raises(UnsupportedOpError, match=r"node '\w+'"):
        mexc.compile(_Read(use), (torch.zeros(4, 1, 8, 8),))
