"""A classifier of token sequences: its input is integer ids, read through embedding tables.

`mexc train examples/tokens.py:DigitTokens --data digits-tokens --compare-fp32` trains it
integer-only beside FP32 on scikit-learn's digits, each image a sequence of 64 ids (its pixels'
intensities 0..16, mexc.data): a token table and a table of positions looked up at
torch.arange(64), a 2-layer pre-norm nn.TransformerEncoder, the mean over the tokens and a
linear head, as a text classifier reads words."""

from __future__ import annotations

import torch
from torch import nn


class TokenClassifier(nn.Module):
    def __init__(self, vocab: int, length: int, classes: int, d: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(length, d)
        layer = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(
            layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=False
        )
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        at = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.tokens(ids) + self.positions(at)).mean(1))


def DigitTokens() -> nn.Module:
    """For --data digits-tokens: 17 ids (intensities 0..16), 64 positions, 10 classes."""
    return TokenClassifier(17, 64, 10)
