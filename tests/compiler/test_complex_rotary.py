"""Rotary embeddings written as a complex product (Meta's LLaMA: `torch.view_as_complex`, a
`freqs_cis` table of unit complex numbers, `torch.view_as_real`) compile as pairs of reals
(frontend_complex): the model follows torch, trains bit-exact on reference, llvm and C, and to
the bit as the same rotation written with real tensors. Other complex arithmetic is refused by
node."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
)

VOCAB, DIM, HEADS, KV_HEADS, T = 40, 32, 4, 2, 8


def _freqs_cis(head_dim: int, end: int) -> torch.Tensor:
    freqs = 1.0 / (100.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [end, head_dim / 2]


def _reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Meta's: the table seen as [1, T, 1, D / 2] from x's shape, with asserts on it."""
    ndim = x.ndim
    assert ndim > 1
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    return freqs_cis.view(*[d if i in (1, ndim - 1) else 1 for i, d in enumerate(x.shape)])


class Attention(nn.Module):
    """Meta LLaMA's attention: grouped keys, the rotation in the [N, T, H, D] layout, the
    causal mask an additive tensor made in forward. rotate="complex" is Meta's code,
    "pairs" the same rotation written with real tensors as frontend_complex writes it."""

    def __init__(self, rotate: str) -> None:
        super().__init__()
        self.rotate, self.head_dim = rotate, DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def _rotated(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        n, t, h, d = x.shape
        if self.rotate == "complex":
            z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            rotated = torch.view_as_real(z * _reshape_for_broadcast(freqs_cis, z)).flatten(3)
            return rotated.type_as(x)
        if self.rotate == "complex_view":  # no asserts: traced symbolically
            z = torch.view_as_complex(x.reshape(n, t, h, d // 2, 2))
            return torch.view_as_real(z * freqs_cis.view(1, t, 1, d // 2)).flatten(3)
        pairs = x.reshape(n, t, h, d // 2, 2)
        table = torch.view_as_real(freqs_cis).view(1, t, 1, d // 2, 2)
        re, im = table[..., :1], table[..., 1:]
        real = torch.cat([re, re], -1)
        imag = torch.cat([-im, im], -1)
        return (pairs * real + torch.roll(pairs, 1, -1) * imag).flatten(3)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q = self._rotated(self.wq(x).view(n, t, HEADS, self.head_dim), freqs_cis)
        k = self._rotated(self.wk(x).view(n, t, KV_HEADS, self.head_dim), freqs_cis)
        v = self.wv(x).view(n, t, KV_HEADS, self.head_dim)
        k = k[:, :, :, None, :].expand(n, t, KV_HEADS, HEADS // KV_HEADS, self.head_dim)
        v = v[:, :, :, None, :].expand(n, t, KV_HEADS, HEADS // KV_HEADS, self.head_dim)
        k = k.reshape(n, t, HEADS, self.head_dim).transpose(1, 2)
        v = v.reshape(n, t, HEADS, self.head_dim).transpose(1, 2)
        scores = q.transpose(1, 2) @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).contiguous().view(n, t, -1))


class Llama(nn.Module):
    """A one-block LLaMA as Meta writes it: the table a plain tensor attribute sliced to the
    sequence in forward, RMSNorm written out, SwiGLU."""

    def __init__(self, rotate: str = "complex") -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.attention = Attention(rotate)
        self.w1, self.w3 = nn.Linear(DIM, 64, bias=False), nn.Linear(DIM, 64, bias=False)
        self.w2 = nn.Linear(64, DIM, bias=False)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.rotate = rotate
        if rotate == "complex_view":  # buffers, their slices and views nodes of the graph
            self.register_buffer("freqs_cis", _freqs_cis(DIM // HEADS, 2 * T), persistent=False)
            mask = torch.triu(torch.full((2 * T, 2 * T), float("-inf")), diagonal=1)
            self.register_buffer("mask", mask, persistent=False)
        else:
            self.freqs_cis = _freqs_cis(DIM // HEADS, 2 * T)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        if self.rotate == "complex_view":  # torch.narrow reads the buffer into the graph
            freqs_cis = torch.narrow(self.freqs_cis, 0, 0, seqlen)
            mask = torch.narrow(torch.narrow(self.mask, 0, 0, seqlen), 1, 0, seqlen)
        else:  # Meta's (Llama 2): the table moved to the device and sliced, the mask made here
            self.freqs_cis = self.freqs_cis.to(h.device)
            freqs_cis = self.freqs_cis[0:seqlen]
            mask = torch.triu(torch.full((seqlen, seqlen), float("-inf")), diagonal=1)
        h = h + self.attention(self._norm(h), freqs_cis, mask)
        x = self._norm(h)
        h = h + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.output(self._norm(h)).transpose(1, 2)  # [N, V, T]


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB, (4, T)), rng.integers(0, VOCAB, (4, T))


def _program(target: str = "reference", rotate: str = "complex") -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Llama(rotate), (torch.zeros(4, T, dtype=torch.long),), target=target)


def test_the_complex_rotation_follows_torch() -> None:
    torch.manual_seed(0)
    model = Llama()
    prog = mexc.compile(model, (torch.zeros(4, T, dtype=torch.long),))
    ids, y = _data()
    assert_logits_match_torch(model, prog, ids)
    names = ("attention.wq.weight", "attention.wk.weight", "w1.weight", "output.weight")
    assert_gradients_follow_autograd(model, prog, ids, y, names, 0.99)


def test_each_product_holds_its_table_as_two_real_factors_with_the_heads_filled_in() -> None:
    state = _program().state
    factors = {k: v.shape for k, v in state.items() if "_mexc_complex_" in k}
    half = DIM // HEADS // 2
    # per product: [c, c] cut to [c] along the pair axis, and [-d, d]; the table's [1, T, 1,
    # D / 2] is repeated over the heads, so that it varies along one run of axes
    assert sorted(factors.values()) == sorted(
        [(1, T, HEADS, half, 1), (1, T, HEADS, half, 2)]
        + [(1, T, KV_HEADS, half, 1), (1, T, KV_HEADS, half, 2)]
    ), factors
    table = _freqs_cis(DIM // HEADS, 2 * T)[:T].numpy()[None, :, None, :]  # [1, T, 1, D / 2]
    re = next(v for k, v in state.items() if k.endswith("_re") and v.shape[2] == HEADS)
    im = next(v for k, v in state.items() if k.endswith("_im") and v.shape[2] == HEADS)
    step = 2.0**-6  # int8 mantissas of values up to 1
    assert np.abs(re.dequantize()[..., 0] - table.real).max() <= step
    assert np.abs(im.dequantize() - np.stack([-table.imag, table.imag], -1)).max() <= step


def test_it_trains_to_the_bit_as_the_rotation_written_with_real_tensors() -> None:
    ids, y = _data()
    got, want = _program(rotate="complex"), _program(rotate="pairs")
    for _ in range(3):
        assert got.step(ids, y) == want.step(ids, y)
        # every tensor alike; the constants' names differ (the rewrite's, the trace's)
        assert _contents(got) == _contents(want)


def _contents(prog: mexc.Program) -> list[tuple[str, bytes, bytes]]:
    """The state's tensors (mantissas, exponents) by name, the constants by value alone."""
    return sorted(
        ("" if k.startswith("mexc.") else k, v.m.tobytes(), np.asarray(v.e).tobytes())
        for k, v in prog.state.items()
    )


def test_a_buffer_sliced_and_viewed_in_the_graph_trains_as_the_traced_constant_does() -> None:
    model = Llama("complex_view")
    graph = torch.fx.symbolic_trace(model).graph  # traced without the example's shapes
    assert [n.target for n in graph.nodes if n.op == "get_attr"].count("freqs_cis") == 1
    ids, y = _data()
    got, want = _program(rotate="complex_view"), _program()
    for _ in range(2):
        assert got.step(ids, y) == want.step(ids, y)
    assert _contents(got) == _contents(want)


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(_program(), lambda target: _program(target), _data())


class Other(nn.Module):
    """A complex activation used in ways mexc does not compute."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.proj = nn.Linear(8, 8)
        self.fc = nn.Linear(16, 10)
        self.theta = nn.Parameter(torch.linspace(0.0, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.proj(x.flatten(1, 2))  # [N, 8, 8]
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], 4, 2))
        if self.use == "square":
            z = z * z
        elif self.use == "real":
            z = z * t[..., :4]
        elif self.use == "learned":  # learned frequencies: a factor the program would freeze
            z = z * torch.polar(torch.ones(4), self.theta)
        else:  # abs: a real tensor from a complex one
            return self.fc(torch.cat([z.abs(), z.abs()], -1).flatten(1)[:, :16])
        return self.fc(torch.view_as_real(z).flatten(2).mean(1).repeat(1, 2))


@pytest.mark.parametrize(
    "use, says",
    [
        ("square", "multiplies two complex activations"),
        ("real", "combines a complex tensor with the real activation"),
        ("abs", "reads a complex tensor"),
        ("learned", "by a function of the parameter 'theta'"),
    ],
)
def test_other_complex_arithmetic_is_refused_by_node(use: str, says: str) -> None:
    with pytest.raises(UnsupportedOpError) as err:
        mexc.compile(Other(use), (torch.zeros(2, 1, 8, 8),))
    text = str(err.value)
    assert says in text and "test_complex_rotary.py:" in text and "node '" in text, text
    assert "torch.view_as_real" in text  # what is computed
