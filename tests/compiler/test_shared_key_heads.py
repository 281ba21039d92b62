"""Scaled dot-product attention whose keys and values have fewer heads than its queries:
multi-query attention (one key head, broadcast: MobileNetV4's hybrid blocks) and grouped-query
attention (`enable_gqa=True`, each key head repeated for consecutive query heads). Against
torch and autograd, bit-exact on reference, llvm and C, and other head counts refused."""

from __future__ import annotations

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
    small_batch,
)


class SharedKeys(nn.Module):
    """4 query heads over 4 tokens of 16 features; `kv` key and value heads."""

    def __init__(self, kv: int, gqa: bool) -> None:
        super().__init__()
        self.kv, self.gqa = kv, gqa
        self.q = nn.Linear(16, 32)
        self.k = nn.Linear(16, 8 * kv)
        self.v = nn.Linear(16, 8 * kv)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 64]
        t = x.view(-1, 4, 16)
        b = t.shape[0]
        q = self.q(t).view(b, 4, 4, 8).transpose(1, 2)
        k = self.k(t).view(b, 4, self.kv, 8).transpose(1, 2)
        v = self.v(t).view(b, 4, self.kv, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.gqa)
        return self.out(y.transpose(1, 2).reshape(b, 4, 32).mean(1))


CASES = [(1, False), (2, True)]


def _model(kv: int, gqa: bool) -> SharedKeys:
    torch.manual_seed(0)
    return SharedKeys(kv, gqa)


@pytest.mark.parametrize(("kv", "gqa"), CASES)
def test_logits_match_torch(kv: int, gqa: bool) -> None:
    model = _model(kv, gqa)
    prog = mexc.compile(model, (torch.zeros(8, 64),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 64))[0], rel=0.03)


@pytest.mark.parametrize(("kv", "gqa"), CASES)
def test_gradients_follow_autograd(kv: int, gqa: bool) -> None:
    model = _model(kv, gqa)
    prog = mexc.compile(model, (torch.zeros(32, 64),))
    x, y = small_batch((32, 64))
    assert_gradients_follow_autograd(
        model, prog, x, y, ("q.weight", "k.weight", "v.weight", "out.weight"), 0.99
    )


def test_grouped_query_attention_trains_bit_exact_on_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        return mexc.compile(_model(2, True), (torch.zeros(4, 64),), target=target)

    batch = small_batch((4, 64))
    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, batch)


class OneQueryHead(nn.Module):
    """One query head over four key heads: torch broadcasts the query; mexc refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 8)
        self.k = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.view(-1, 4, 16)
        b = t.shape[0]
        q = self.q(t).view(b, 4, 1, 8).transpose(1, 2)
        k = self.k(t).view(b, 4, 4, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, k)
        return self.out(y.transpose(1, 2).reshape(b, 4, 32).mean(1))


def test_fewer_query_heads_than_key_heads_are_refused_by_node() -> None:
    with pytest.raises(UnsupportedOpError, match="leading .batch, head. axes differ") as err:
        mexc.compile(OneQueryHead(), (torch.zeros(4, 64),), target="reference")
    assert "test_shared_key_heads.py" in str(err.value)
