"""A rotary position table the forward computes from a float tensor (timm's DINOv3 RoPE:
`coords / self.periods`, then sin and cos concatenated and chunked apart again) is a constant
of the program: arithmetic on float constants and the pieces of a constant fold on the host
(frontend_fold, frontend._getitem). The model trains as torch computes it, and bit-exact on
reference, llvm and C."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

import mexc
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
)


class Rotary(nn.Module):
    """Tokens of an 8 x 8 image's rows, rotated by angles coords / periods."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        # a plain tensor attribute, which fx reads as a constant of its own (`_tensor_constant0`,
        # as DINOv3's periods are read once the shape-aware retrace has run)
        self.periods = 10.0 ** torch.linspace(0, 2, 4)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.proj(x.flatten(1, 2))  # [N, 8, 16]
        # from the tokens' count, so that fx traces the table's ops (a concrete arange would
        # make the whole table one constant)
        coords = torch.arange(t.shape[1], dtype=torch.float32)[:, None]  # [8, 1]
        angles = 2 * math.pi * coords / self.periods[None, :]  # [8, 4]
        angles = torch.cat([angles, angles], -1)  # [8, 8]
        table = torch.cat([angles.sin(), angles.cos()], -1)  # [8, 16]
        sin, cos = table.chunk(2, -1)  # [8, 8] each
        sin, cos = torch.cat([sin, sin], -1), torch.cat([cos, cos], -1)
        half = torch.cat([-t[..., 8:], t[..., :8]], -1)
        return self.fc((t * cos + half * sin).mean(1))


def _program(target: str = "reference") -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Rotary(), (torch.zeros(4, 1, 8, 8),), target=target)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 4)


def test_the_rotary_table_is_torchs() -> None:
    torch.manual_seed(0)
    model = Rotary()
    prog = mexc.compile(model, (torch.zeros(16, 1, 8, 8),), rounding="nearest")
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 16)
    assert_logits_match_torch(model, prog, x)
    assert_gradients_follow_autograd(model, prog, x, y, ("proj.weight", "fc.weight"), 0.99)


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(_program(), _program, _data())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class HuggingFaceRotary(nn.Module):
    """Hugging Face's LlamaRotaryEmbedding: cos and sin computed in forward from position ids
    expanded over the batch (`inv_freq @ position_ids`), unsqueezed to [N, 1, T, D] for the
    heads, or (`table`) the same angles from a [T, D] table."""

    def __init__(self, table: bool) -> None:
        super().__init__()
        self.table = table
        self.tokens = nn.Embedding(20, 16)
        self.q = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, 8, 2).float() / 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, t = ids.shape
        q = self.q(self.tokens(ids)).view(n, t, 2, 8).transpose(1, 2)
        if self.table:
            freqs = torch.outer(torch.arange(t).to(self.inv_freq.dtype), self.inv_freq)
            cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        else:
            positions = torch.arange(t)[None].expand(n, -1)
            inv = self.inv_freq[None, :, None].expand(n, -1, 1)
            freqs = (inv @ positions[:, None, :].to(inv.dtype)).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q = q * cos + _rotate_half(q) * sin
        return self.head(q.transpose(1, 2).reshape(n, t, 16)).transpose(1, 2)


def test_a_table_made_per_sample_is_one_factor_for_every_sample() -> None:
    """The trace makes Hugging Face's cos and sin constants of [N, 1, T, D]: the same for every
    sample, so the product takes them as one [1, 1, T, D] factor (it was refused: a factor
    varying along the batch and the positions is not one run of axes). Logits and gradients
    follow torch's, as the model written with a [T, D] table does."""
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 20, (4, 6)), rng.integers(0, 20, (4, 6))
    for table in (False, True):
        torch.manual_seed(0)
        model = HuggingFaceRotary(table)
        prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
        factors = [v.m.shape for k, v in prog.state.items() if k.startswith("mexc.")]
        assert all(len(f) != 4 or f[0] == 1 for f in factors), factors
        assert_logits_match_torch(model, prog, ids)
        names = ("tokens.weight", "q.weight", "head.weight")
        assert_gradients_follow_autograd(model, prog, ids, y, names, 0.99)


class BothRotated(HuggingFaceRotary):
    """HuggingFaceRotary with the keys rotated too, by the same cos and sin."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, t = ids.shape
        x = self.tokens(ids)
        q, k = (self.q(a).view(n, t, 2, 8).transpose(1, 2) for a in (x, 2 * x))
        positions = torch.arange(t)[None].expand(n, -1)
        inv = self.inv_freq[None, :, None].expand(n, -1, 1)
        emb = (inv @ positions[:, None, :].to(inv.dtype)).transpose(1, 2).repeat(1, 1, 2)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q, k = (a * cos + _rotate_half(a) * sin for a in (q, k))
        return self.head((q + k).transpose(1, 2).reshape(n, t, 16)).transpose(1, 2)


def test_a_table_two_products_read_is_held_once() -> None:
    """cos and sin, each read by the queries' and the keys' products, are one constant each
    (each read made a copy of its own)."""
    torch.manual_seed(0)
    prog = mexc.compile(BothRotated(False), (torch.zeros(4, 6, dtype=torch.long),))
    factors = [v.m.shape for k, v in prog.state.items() if k.startswith("mexc.")]
    assert factors == [(1, 1, 6, 8)] * 2, factors
