"""Learned tokens repeated over the batch as users write them: a class token by
`self.cls.repeat(B, 1, 1)`, Perceiver's latents by `self.latents.unsqueeze(0).expand(B, -1,
-1)`, DETR's queries by `self.query_embed.weight.unsqueeze(0).repeat(B, 1, 1)` multiplied with
the input, and as DETR's transformer.py writes them, sequence first (`unsqueeze(1).repeat(1,
B, 1)`) beside a `torch.zeros_like` target. Each is the parameter repeated over the batch
(`expand_param`, whose gradient sums the samples'; moved to the second axis by a transpose),
as `self.cls.expand(B, -1, -1)` was: the same program, and each follows torch. They were
refused as parameters read through indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    train_checksums,
)


class Tokens(nn.Module):
    """Tokens [N, 8, 16] with learned tokens joined or attending over them."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        self.latents = nn.Parameter(torch.randn(4, 16))
        self.query_embed = nn.Embedding(3, 16)  # fewer queries than samples
        self.norm = nn.LayerNorm(16)
        self.attention = nn.MultiheadAttention(16, 2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        if self.form in ("expand", "repeat"):
            cls = self.cls.expand(n, -1, -1) if self.form == "expand" else self.cls.repeat(n, 1, 1)
            t = torch.cat([cls, x], 1)
        elif self.form == "latents":  # attend from the latents to the tokens
            q = self.latents.unsqueeze(0).expand(n, -1, -1)
            t = torch.softmax(q @ x.transpose(1, 2) / 4.0, -1) @ x + q
        elif self.form == "queries":  # DETR's queries
            q = self.query_embed.weight.unsqueeze(0).repeat(n, 1, 1)
            t = torch.softmax(q @ x.transpose(1, 2) / 4.0, -1) @ x
        else:  # as DETR's transformer.py: sequence first, the target zeros_like the queries
            q = self.query_embed.weight.unsqueeze(1).repeat(1, n, 1)  # [3, N, 16]
            target = torch.zeros_like(q)
            memory = x.transpose(0, 1)
            t = (target + self.attention(target + q, memory, memory)[0]).transpose(0, 1)
        return self.fc(self.norm(t).mean(1))


PARAMETER = {
    "expand": "cls",
    "repeat": "cls",
    "latents": "latents",
    "queries": "query_embed.weight",
    "sequence_first": "query_embed.weight",
}


def _program(form: str, target: str = "reference") -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Tokens(form), (torch.zeros(4, 8, 16),), target=target)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 8, 16)).astype(np.float32), rng.integers(0, 10, 4)


@pytest.mark.parametrize("form", ["repeat", "latents", "queries", "sequence_first"])
def test_the_tokens_follow_torch(form: str) -> None:
    torch.manual_seed(0)
    model = Tokens(form)
    prog = mexc.compile(model, (torch.zeros(4, 8, 16),), rounding="nearest")
    x, y = _data()
    repeated = [n for n in prog.graph.nodes if n.op is Op.EXPAND_PARAM]
    assert len(repeated) == 1, repeated
    assert_logits_match_torch(model, prog, x)
    assert_gradients_follow_autograd(model, prog, x, y, (PARAMETER[form], "fc.weight"), 0.99)


def test_repeat_is_the_program_expand_makes() -> None:
    x, y = _data()
    assert train_checksums(_program("repeat"), (x, y)) == train_checksums(
        _program("expand"), (x, y)
    )
