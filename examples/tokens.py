"""Models whose input is integer token ids, read through embedding tables.

`mexc train examples/tokens.py:DigitTokens --data digits-tokens --compare-fp32` trains a
classifier of token sequences integer-only beside FP32 on scikit-learn's digits, each image a
sequence of 64 ids (its pixels' intensities 0..16, mexc.data): a token table and a table of
positions looked up at torch.arange(64), a 2-layer pre-norm nn.TransformerEncoder, the mean over
the tokens and a linear head, as a text classifier reads words.

`mexc train examples/tokens.py:DigitsNext --data digits-next --compare-fp32` trains a causal
language model of the same sequences: at every position, the next intensity.

`mexc train examples/tokens.py:DigitsSparse --data digits-sparse --compare-fp32` classifies
padded sequences of varying length: a class token and one id per nonzero pixel (its place and
one of 4 intensity levels), 17 to 43 ids padded to 48, the padding hidden from the attention by
`src_key_padding_mask = ids == 0`, as a text classifier reads a padded batch of sentences."""

from __future__ import annotations

import torch
from torch import nn


class TokenEncoder(nn.Module):
    """Token and position tables (the positions looked up at torch.arange(T)) and a 2-layer
    pre-norm nn.TransformerEncoder (4 heads, GELU); `causal`: under the square subsequent
    mask, each position reads the ids up to its own."""

    def __init__(self, vocab: int, length: int, d: int, causal: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(length, d)
        layer = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(
            layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=False
        )
        self.causal = causal
        if causal:
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        if self.causal:
            return self.encoder(h, mask=self.mask, is_causal=True)
        return self.encoder(h)


class TokenClassifier(nn.Module):
    """One class per sequence: the mean of the encoder's outputs over the tokens, a linear
    head."""

    def __init__(self, vocab: int, length: int, classes: int, d: int = 32) -> None:
        super().__init__()
        self.encoder = TokenEncoder(vocab, length, d, causal=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(ids).mean(1))


class NextTokenModel(nn.Module):
    """A causal language model: a linear head over the vocabulary at every position. Its
    logits are [N, V, T], the classes on axis 1 as F.cross_entropy reads them: one label per
    position."""

    def __init__(self, vocab: int, length: int, d: int = 32) -> None:
        super().__init__()
        self.encoder = TokenEncoder(vocab, length, d, causal=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(ids)).transpose(1, 2)


class PaddedClassifier(nn.Module):
    """Padded sequences (id `pad` pads): a token table, a 2-layer pre-norm
    nn.TransformerEncoder whose attention hides the padding (src_key_padding_mask), a linear
    head on the first token (the class token). No position table: here each id names its
    place."""

    def __init__(self, vocab: int, classes: int, pad: int = 0, d: int = 32) -> None:
        super().__init__()
        self.pad = pad
        self.tokens = nn.Embedding(vocab, d, padding_idx=pad)
        layer = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(
            layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=False
        )
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.tokens(ids), src_key_padding_mask=ids == self.pad)
        return self.head(h[:, 0])


def DigitTokens() -> nn.Module:
    """For --data digits-tokens: 17 ids (intensities 0..16), 64 positions, 10 classes."""
    return TokenClassifier(17, 64, 10)


def DigitsNext() -> nn.Module:
    """For --data digits-next: the next of 17 intensities after each of 63 pixels."""
    return NextTokenModel(17, 63)


def DigitsSparse() -> nn.Module:
    """For --data digits-sparse: 258 ids (padding, the class token, 64 places x 4 intensity
    levels), 10 classes."""
    return PaddedClassifier(258, 10)
