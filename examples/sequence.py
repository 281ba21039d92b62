"""Sequence classifiers built from torch's own transformer layers: each image row is a token.

`mexc train examples/sequence.py:FashionRows --data fashion-mnist --compare-fp32` trains the
nn.TransformerEncoder below integer-only beside FP32; FashionRowsCausal reads the rows in order,
each attending to the rows above it (the square subsequent mask)."""

from __future__ import annotations

import torch
from torch import nn


class RowTransformer(nn.Module):
    """Rows (N, 1, H, W) -> (N, H, W) tokens, embedded, a learned position per row, a 2-layer
    pre-norm nn.TransformerEncoder, the mean over the rows, a linear head."""

    def __init__(self, rows: int = 28, width: int = 28, d: int = 64, causal: bool = False):
        super().__init__()
        self.rows, self.width, self.causal = rows, width, causal
        self.embed = nn.Linear(width, d)
        self.pos = nn.Parameter(torch.randn(1, rows, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(
            layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=False
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(rows))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.reshape(-1, self.rows, self.width)) + self.pos
        if self.causal:
            y = self.encoder(tokens, mask=self.mask, is_causal=True)
        else:
            y = self.encoder(tokens)
        return self.head(y.mean(1))


def FashionRows() -> nn.Module:
    return RowTransformer()


def FashionRowsCausal() -> nn.Module:
    return RowTransformer(causal=True)
