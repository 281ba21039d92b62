"""Parameters concatenated where they meet an activation (BEiT's and EVA's q/k/v bias,
torch.cat((q_bias, k_bias, v_bias)) with k_bias a zero buffer, passed to F.linear), and the
rest of EVA's rotary embedding: torch.stack of activations and Tensor.to. Against torch, and
bit-exact on reference, llvm and C."""

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


def rot(x: torch.Tensor) -> torch.Tensor:
    """timm's rotary helper: [x0, x1, x2, x3] -> [-x1, x0, -x3, x2]."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


class QkvBias(nn.Module):
    """BEiT's attention projection (a bias made of two parameters and a zero buffer), a
    gate made of two parameters concatenated along the tokens, and EVA's rotary embedding of
    the queries (sin and cos buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)
        self.q_bias = nn.Parameter(torch.randn(16) / 2)
        self.v_bias = nn.Parameter(torch.randn(16) / 2)
        self.register_buffer("k_bias", torch.zeros(16), persistent=False)
        self.near = nn.Parameter(1 + torch.randn(3, 1) / 4)
        self.far = nn.Parameter(1 + torch.randn(5, 1) / 4)
        angles = torch.arange(8)[:, None] * torch.arange(1, 9)[None, :] / 8.0
        self.register_buffer("sin", angles.sin())
        self.register_buffer("cos", angles.cos())
        self.fc = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8, 16]
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias=bias)  # [B, 8, 48]
        q, kv = qkv[..., :8], qkv[..., 8:]
        q = (q * self.cos + rot(q) * self.sin).to(x.dtype)
        y = torch.cat([q, kv], -1) * torch.cat([self.near, self.far])  # a gate per token
        return self.fc(y.mean(1))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 8, 16)).astype(np.float32), rng.integers(0, 10, batch)


def _program(target: str = "reference", batch: int = 8, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(QkvBias(), (torch.zeros(batch, 8, 16),), target=target, **kw)


def test_the_concatenated_parts_are_gathered_and_the_zero_buffer_is_a_constant() -> None:
    prog = _program()
    names = {
        str(prog.graph.node(n.inputs[0].node).attrs.name)
        for n in prog.graph.nodes_of(Op.GATHER_PARAM)
    }
    assert {"q_bias", "v_bias", "near", "far"} <= names and "mexc.k_bias" in names
    assert "mexc.k_bias.velocity" not in prog.state and "q_bias.velocity" in prog.state
    assert not prog.state["mexc.k_bias"].m.any()


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = QkvBias()
    prog = mexc.compile(model, (torch.zeros(8, 8, 16),), rounding="nearest")
    # measured 0.053 of the largest logit (cosine 0.9992): the rotation and the gate round
    # the queries to int8 three more times than a plain attention projection
    assert_logits_match_torch(model, prog, _data(8)[0], rel=0.08)


@pytest.mark.parametrize("name", ["q_bias", "v_bias", "near", "far"])
def test_the_parts_get_their_own_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = QkvBias()
    prog = mexc.compile(model, (torch.zeros(32, 8, 16),))
    x, y = _data(32)
    got = integer_gradients(prog, x, y)[name]
    want = float_gradients(model, prog, x, y)[name]
    assert cosine(got, want) >= 0.98, cosine(got, want)


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    x, y = _data(4)
    assert_trains_bit_exact_on_llvm_and_c(_program(batch=4), lambda t: _program(t, batch=4), (x, y))


class _Cast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int64).float()[:, :10]


@pytest.mark.parametrize(("make", "message"), [(_Cast, "casts an activation to torch.int64")])
def test_casts_mexc_cannot_train_are_refused_by_node(make, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(make(), (torch.zeros(4, 16),))
    assert "node '" in str(err.value)
