"""Masks of the token ids read as tensors, and float masks of the ids that hide attention keys.

Read as tensors: a masked mean over the tokens (`(h * m).sum(1) / m.sum(1)`, the sentence-
transformers form with expand and clamp), `h.masked_fill(ids == pad, 0.0)`, torch.where. The
mask is an `embedding` of the ids in a constant table of one column (docs/frontend.md).

Hiding keys: Hugging Face's `scores + (1.0 - mask) * -10000.0` (or `* torch.finfo(dtype).min`),
the Annotated Transformer's `scores.masked_fill(mask == 0, -1e9)` and such a mask as SDPA's float
attn_mask are the softmax's key mask, as `masked_fill(mask, -inf)` is: the same program, bit for
bit. Against torch and autograd, bit-exact on reference, llvm and C, and the masks mexc cannot
read refused by node."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.frontend import import_model
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    train_checksums,
)

VOCAB, T, D, PAD = 40, 8, 16, 0


def padded(n: int) -> np.ndarray:
    """Token ids with 1..T real tokens per row, the rest PAD."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, VOCAB, (n, T))
    for i in range(n):
        ids[i, 1 + (3 * i) % T :] = PAD
    return ids


def labels(n: int) -> np.ndarray:
    return np.random.default_rng(2).integers(0, 10, n)


class Pooled(nn.Module):
    """Tokens, a linear layer and a masked mean over the real tokens, in one of four forms."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(self.tokens(ids)))
        if self.form == "expand":  # sentence-transformers' mean pooling
            m = (ids != PAD).unsqueeze(-1).expand(h.size()).float()
            return self.head((h * m).sum(1) / torch.clamp(m.sum(1), min=1e-9))
        if self.form == "float":
            m = (ids != PAD).float()
            return self.head((h * m[..., None]).sum(1) / m.sum(1, keepdim=True))
        if self.form == "masked_fill":
            pad = ids == PAD
            return self.head(h.masked_fill(pad[..., None], 0.0).sum(1) / (~pad).sum(1)[:, None])
        return self.head(torch.where((ids != PAD)[..., None], h, 0.0).mean(1))  # "where"


POOLINGS = ("expand", "float", "masked_fill", "where")


@pytest.mark.parametrize("form", POOLINGS)
def test_a_masked_mean_matches_torch(form: str) -> None:
    torch.manual_seed(0)
    model = Pooled(form)
    ids = padded(16)
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    lookups = [n for n in prog.graph.nodes if n.op is Op.EMBEDDING]
    assert len(lookups) == (3 if form == "masked_fill" else 2)  # the tokens, the masks' tables
    assert_logits_match_torch(model, prog, ids, rel=0.03)
    got, want = (
        integer_gradients(prog, ids, labels(16)),
        float_gradients(model, prog, ids, labels(16)),
    )
    assert sorted(got) == ["fc.bias", "fc.weight", "head.bias", "head.weight", "tokens.weight"]
    for name in got:
        # the quotient by the count rounds twice: fc.bias 0.953 where the mean's form is 0.995
        assert cosine(got[name], want[name]) >= 0.94, (name, cosine(got[name], want[name]))


def test_the_mask_table_holds_the_comparison_for_every_id() -> None:
    torch.manual_seed(0)
    front = import_model(Pooled("masked_fill"), torch.from_numpy(padded(4)))
    tables = {k: v for k, v in front.params.items() if k.startswith("mexc.id_mask")}
    assert sorted(tables) == ["mexc.id_mask_eq_0", "mexc.id_mask_ne_0"]  # `pad` and `~pad`
    pad = (np.arange(VOCAB) == PAD).astype(np.float32)[:, None]
    np.testing.assert_array_equal(tables["mexc.id_mask_eq_0"], pad)
    np.testing.assert_array_equal(tables["mexc.id_mask_ne_0"], 1 - pad)
    assert set(tables) <= front.constants  # never trained


class Attention(nn.Module):
    """Two heads over the tokens whose padding keys a mask of the ids hides, in one of five
    forms, then a masked mean."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.tokens = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, t = ids.shape
        q, k, v = self.qkv(self.tokens(ids)).view(n, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        keep = (ids != PAD)[:, None, None, :]
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // 2)
        if self.form == "inf":
            p = F.softmax(scores.masked_fill(~keep, float("-inf")), -1)
        elif self.form == "annotated":  # the Annotated Transformer
            p = F.softmax(scores.masked_fill(keep == 0, -1e9), -1)
        elif self.form == "additive":  # Hugging Face's extended attention mask
            p = F.softmax(scores + (1.0 - keep.float()) * -10000.0, dim=-1)
        elif self.form == "finfo":
            p = (torch.finfo(scores.dtype).min * (1.0 - keep.to(q.dtype)) + scores).softmax(-1)
        elif self.form == "hf_expand":  # transformers' _expand_mask / 4-d attention mask
            inverted = 1.0 - keep.expand(n, 1, t, t).to(q.dtype)
            added = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(q.dtype).min)
            p = F.softmax(scores + added, dim=-1)
        else:  # "sdpa": the additive mask as SDPA's attn_mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=(1.0 - keep.float()) * -1e4)
        if self.form != "sdpa":
            y = p @ v
        m = (ids != PAD).float()[..., None]
        h = y.transpose(1, 2).reshape(n, t, D)
        return self.head((h * m).sum(1) / m.sum(1))


def _attention(form: str, target: str = "reference", n: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    model = Attention(form)
    with torch.no_grad():
        model.qkv.weight *= 4  # scores that matter
    return mexc.compile(model, (torch.from_numpy(padded(n)),), target=target)


def test_float_masks_hide_the_keys_as_masked_fill_with_minus_inf_does() -> None:
    ids, y = padded(8), labels(8)
    want = train_checksums(_attention("inf"), (ids, y))
    for form in ("annotated", "additive", "finfo", "hf_expand", "sdpa"):
        prog = _attention(form)
        (softmax,) = prog.graph.nodes_of(Op.SOFTMAX)
        assert (softmax.attrs.key_cmp, softmax.attrs.key_value) == ("eq", PAD), form
        assert train_checksums(prog, (ids, y)) == want, form


def test_logits_and_gradients_with_an_additive_mask_match_torch() -> None:
    torch.manual_seed(0)
    model = Attention("additive")
    with torch.no_grad():
        model.qkv.weight *= 4
    ids = padded(16)
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    assert_logits_match_torch(model, prog, ids, rel=0.05)
    got, want = (
        integer_gradients(prog, ids, labels(16)),
        float_gradients(model, prog, ids, labels(16)),
    )
    for name in ("qkv.weight", "tokens.weight", "head.weight"):
        assert cosine(got[name], want[name]) >= 0.95, (name, cosine(got[name], want[name]))


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    """The mask's table lookup, its broadcast and the quotient by its count (the added masks
    are the key-masked softmax, whose programs test_attention_masks trains on every target)."""
    ids = padded(6)
    batch = (ids, labels(6))

    def pooled(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(Pooled("expand"), (torch.from_numpy(ids),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(pooled("reference"), pooled, batch)


class _LargeMask(Pooled):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # a bias of 100 on real tokens
        return self.head((self.fc(self.tokens(ids)) + (ids != PAD)[..., None] * 100.0).mean(1))


class _NotHiding(Attention):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # -5000: neither hides nor fits
        scores = self.qkv(self.tokens(ids))[..., :T]
        p = F.softmax(scores + (1.0 - (ids != PAD).float()[:, None, :]) * -5000.0, -1)
        return self.head(p @ self.tokens(ids)).mean(1)


class _TwoMasksScaled(Attention):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # a product of masks, not followed
        keep = (ids != PAD).float() * (ids != 5).float()
        scores = self.qkv(self.tokens(ids))[..., :T]
        p = F.softmax(scores + (1.0 - keep[:, None, :]) * -1e4, -1)
        return self.head(p @ self.tokens(ids)).mean(1)


class _MaskedMaxPool(Pooled):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # a maximum over the real tokens
        h = self.fc(self.tokens(ids)) + (1.0 - (ids != PAD).float())[..., None] * -1e4
        return self.head(h.amax(1))


class _LargeFill(Pooled):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.tokens(ids)).masked_fill((ids == PAD)[..., None], 100.0)
        return self.head(h.mean(1))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_LargeMask, r"'add'.*mask of the token ids holding 100 and 0 as a tensor"),
        (_NotHiding, r"mask of the token ids holding 0 and -5000 as a tensor"),
        (_LargeFill, r"'masked_fill'.*fills with 100.0.*at most 8 in size"),
        # mexc does not follow the mask to a softmax, and the sums' exponents would be the 1e4's
        (_TwoMasksScaled, r"'add'.*adds a mask whose values can reach 20000 in size"),
        (_MaskedMaxPool, r"'add'.*mask of the token ids holding 0 and -10000 as a tensor"),
    ],
)
def test_masks_mexc_cannot_read_are_refused_by_node(model: type[nn.Module], message: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(model("float"), (torch.from_numpy(padded(4)),))
    assert "test_id_masks_as_tensors.py" in str(err.value)
