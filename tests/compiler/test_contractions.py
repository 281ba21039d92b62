"""torch.einsum and torch.matmul beyond [..., M, K] @ [..., K, N] (mexc.ops.contraction): two
activations as one batched matmul, an activation and a parameter as one linear layer with the
parameter held rearranged. torch's values and gradients, bit-exact training on reference, llvm
and C, and the refusals by node."""

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
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
)


class Contractions(nn.Module):
    """Attention written with einsum (heads as a middle axis), x @ w, q @ rel.T (BoTNet's
    relative logits), an einsum with a 3-D weight, a matrix-vector product, and a broadcast
    batched matmul (one attention map for every head)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.w = nn.Parameter(torch.randn(16, 24) / 4)
        self.rel = nn.Parameter(torch.randn(7, 8) / 3)
        self.u = nn.Parameter(torch.randn(24, 4, 10) / 5)
        self.v = nn.Parameter(torch.randn(8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8, 16]
        b, t, _ = x.shape
        q, k, v = self.proj(x).reshape(b, t, 3, 2, 8).unbind(2)
        att = torch.einsum("bihd,bjhd->bhij", q, k).softmax(-1)
        o = torch.einsum("b h i j, b j h d -> b i h d", att, v).reshape(b, t, 16)
        shared = att.mean(1, keepdim=True)  # [B, 1, 8, 8], broadcast over the heads
        o2 = (shared @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, 16)
        h = (o + o2) @ self.w  # [B, 8, 24]
        r = q @ self.rel.transpose(-1, -2)  # [B, 8, 2, 7]
        z = torch.einsum("btd,dhe->bthe", h, self.u)  # [B, 8, 4, 10]
        s = torch.matmul(k, self.v)  # [B, 8, 2]
        return z.mean((1, 2)) + r.mean((1, 2, 3)).unsqueeze(1) + s.mean((1, 2)).unsqueeze(1)


def _data(batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 8, 16)).astype(np.float32), rng.integers(0, 10, batch)


def _compile(make: type[nn.Module], x: np.ndarray, target: str = "reference", **kw: object):
    torch.manual_seed(0)
    model = make()
    return model, mexc.compile(model, (torch.from_numpy(x),), target=target, **kw)


def test_contractions_match_torch_and_become_matmuls_and_linears() -> None:
    x, _ = _data()
    model, prog = _compile(Contractions, x, rounding="nearest")
    want = model.eval()(torch.from_numpy(x)).detach().numpy()
    got = prog.logits(x)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert cosine(got, want) > 0.999
    ops = [n.op for n in prog.graph.nodes]
    assert ops.count(Op.MATMUL) == 3 and ops.count(Op.LINEAR_COMPACT) == 5  # proj + 4 here
    # the weights a contraction reads are held [out, in]: w.T, rel as declared, u as (h e, d)
    shapes = {k: v.m.shape for k, v in prog.state.items()}
    assert shapes["w"] == (24, 16) and shapes["rel"] == (7, 8) and shapes["u"] == (40, 24)
    assert shapes["v"] == (1, 8)
    w = prog.state["w"].dequantize()
    assert np.abs(w.T - model.w.detach().numpy()).max() <= np.abs(w).max() / 100


def test_contractions_train_bit_exact_on_llvm_and_c() -> None:
    x, y = _data(4)

    def program(target: str) -> mexc.Program:
        return _compile(Contractions, x, target)[1]

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, (x, y))


class Sums(nn.Module):
    """One-operand einsums that sum axes away: over the tokens, over the features (with the
    kept axes permuted), and over all but the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16 + 8 + 1, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8, 16]
        h = torch.relu(self.proj(x))
        tokens = torch.einsum("btd->bd", h) / 8
        features = torch.einsum("btd->tb", h).t() / 16
        every = torch.einsum("btd->b", h)[:, None] / 128
        return self.head(torch.cat([tokens, features, every], 1))


def test_an_einsum_sum_matches_torch_and_autograd() -> None:
    x, y = _data(16)
    model, prog = _compile(Sums, x, rounding="nearest")
    want = model.eval()(torch.from_numpy(x)).detach().numpy()
    got = prog.logits(x)
    assert cosine(got, want) > 0.999 and np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    g, w = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert min(cosine(g[k], w[k]) for k in ("proj.weight", "head.weight")) >= 0.97


class RightWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 10) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x) @ self.w).mean(1)


def test_a_rearranged_weight_gets_the_gradient_of_its_declared_layout() -> None:
    """x @ w with w [16, 10] held as w.T [10, 16]: the integer gradient, seen back in w's
    layout, against torch's on the program's dequantized weight."""
    x, y = _data(32)
    model, prog = _compile(RightWeight, x)
    grad = integer_gradients(prog, x, y)["w"]
    ref = RightWeight().double()
    with torch.no_grad():
        ref.w.copy_(torch.from_numpy(prog.state["w"].dequantize().T))
    xq = mexc.kernels.quantize(x.astype(np.float64), prog.options.bits).dequantize()
    F.cross_entropy(ref(torch.from_numpy(xq)), torch.from_numpy(y)).backward()
    assert ref.w.grad is not None
    assert cosine(grad.T, ref.w.grad.numpy()) > 0.99


class PerHead(nn.Module):
    """A weight per head ("bnhd,hde->bnhe"): the parameter read over the batch, multiplied as
    an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(2, 8, 5) / 3)
        self.fc = nn.Linear(8 * 2 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).view(x.shape[0], 8, 2, 8)
        return self.fc(torch.einsum("bnhd,hde->bnhe", h, self.w).flatten(1))


def test_a_weight_per_head_is_read_over_the_batch() -> None:
    x, y = _data(32)
    torch.manual_seed(0)
    model = PerHead()
    prog = mexc.compile(model, (torch.from_numpy(x),))
    ops = [n.op for n in prog.graph.nodes]
    assert ops.count(Op.GATHER_PARAM) == 1 and ops.count(Op.MATMUL) == 1
    assert prog.state["w"].m.shape == (2, 8, 5)  # held as declared
    got = integer_gradients(prog, x, y)["w"]
    want = float_gradients(model, prog, x, y)["w"]
    assert cosine(got, want) > 0.99

    def program(target: str) -> mexc.Program:
        return _compile(PerHead, x[:4], target)[1]

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, (x[:4], y[:4]))


class _Eq(nn.Module):
    def __init__(self, eq: str, weight: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.eq = eq
        self.p = nn.Parameter(torch.randn(*weight)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8, 16]
        x = x[:, :, :8]
        y = torch.einsum(self.eq, x, self.p) if self.p is not None else torch.einsum(self.eq, x)
        return y.reshape(x.shape[0], -1)[:, :10]


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, self.w) + x @ self.w).mean(1)[:, :10]


class _Part(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w[:, :10]).mean(1)


class _Samples(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bti,ctj->bcij", x, x).reshape(x.shape[0], -1)[:, :10]


class _Three(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bti,btj,btk->bi", x, x, x)[:, :10]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: _Eq("bii->bi"), "diagonal"),
        (lambda: _Eq("bij->j"), "sum over the batch axis"),
        (lambda: _Eq("btd,de->be", (8, 4)), "own axis 't'"),
        (lambda: _Eq("btd,bd->t", (8, 8)), "batch axis with a parameter"),
        (_Twice, "reads parameter 'w'"),
        (_Part, "part of parameter 'w'"),
        (_Samples, "different samples"),
        (_Three, "3 operands"),
    ],
)
def test_contractions_mexc_cannot_train_are_refused_by_node(make, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(make(), (torch.zeros(8, 8, 16),))
    assert "node '" in str(err.value)


class Reshaped(nn.Module):
    """x @ w.reshape(16, 6) of a [6, 16] parameter: held as a split and a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 16) / 4)
        self.fc = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc((torch.relu(x) @ self.w.reshape(16, 6)).mean(1))


def test_weights_read_rearranged_come_back_in_the_models_layout() -> None:
    """Program.float_weights puts x @ w's held w.T back, and a reshaped weight's too."""
    for make in (RightWeight, Reshaped):
        model, prog = _compile(make, _data(4)[0])
        back = prog.float_weights()["w"]
        assert back.shape == tuple(model.w.shape)
        held = prog.state["w"].dequantize()  # [out, in]: w.T, and w.reshape(16, 6).T
        assert np.array_equal(back.reshape(-1), held.T.reshape(-1))
        assert_logits_match_torch(model, prog, _data(4)[0])
