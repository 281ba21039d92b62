"""Attention whose keys and values have fewer tokens than its queries (PVT's and Twins'
spatial-reduction attention, through F.scaled_dot_product_attention): scores [.., Tq, Tk], a
softmax over the Tk keys; against torch, and bit-exact on reference, llvm and C."""

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
)


class ReducedAttention(nn.Module):
    """Patch tokens attend to a 2 x 2-strided summary of themselves (Tq 16, Tk 4), two heads."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv2d(1, dim, 2, stride=2)
        self.q = nn.Linear(dim, dim)
        self.sr = nn.Conv2d(dim, dim, 2, stride=2)
        self.norm = nn.LayerNorm(dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x)  # (B, D, 4, 4)
        b, d, h, w = y.shape
        tokens = y.flatten(2).transpose(1, 2)  # (B, 16, D)
        q = self.q(tokens).reshape(b, h * w, self.heads, d // self.heads).transpose(1, 2)
        reduced = self.norm(self.sr(y).flatten(2).transpose(1, 2))  # (B, 4, D)
        kv = self.kv(reduced).reshape(b, -1, 2, self.heads, d // self.heads)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, 16, D / heads)
        out = self.proj(out.transpose(1, 2).reshape(b, h * w, d)) + tokens
        return self.head(out.mean(1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(ReducedAttention(), (torch.zeros(4, 1, 8, 8),), target=target, bits=bits)


def test_scores_are_queries_by_keys() -> None:
    prog = _program("reference")
    (softmax,) = prog.graph.nodes_of(Op.SOFTMAX)
    assert tuple(softmax.type.shape) == (4, 2, 16, 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    assert_trains_bit_exact_on_llvm_and_c(_program("reference", bits), lambda t: _program(t, bits))


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = ReducedAttention()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


class MismatchedTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x[:, :4]), self.v(x[:, :2])
        return self.head(F.scaled_dot_product_attention(q, k, v).mean(1))


def test_keys_and_values_of_different_token_counts_are_refused() -> None:
    # torch fails on such shapes when it runs; shape propagation on the meta device does not
    # check them, so mexc names the mismatch itself
    with pytest.raises(UnsupportedOpError, match="k and v one number of tokens"):
        mexc.compile(MismatchedTokens(), (torch.zeros(2, 6, 8),))
