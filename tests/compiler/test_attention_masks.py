"""Attention masks: padded batches of token ids, whose attention hides the keys a mask
computed from the ids names (nn.MultiheadAttention's key_padding_mask, the transformer layers'
src_key_padding_mask, a boolean attn_mask of F.scaled_dot_product_attention, a masked_fill;
docs/layers.md, "Key-masked softmax"), and hand-written causal attention that hides later keys
with masked_fill (nanoGPT's). Against torch and autograd, bit-exact on reference, llvm, C and
the CUDA emulator, rows whose every key is hidden, and the other masks and reads refused by
node."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    step_values,
    train_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

VOCAB, T, D, PAD = 40, 8, 16, 0


class PaddedEncoder(nn.Module):
    """Token (PAD pads) and position tables, an nn.TransformerEncoder of two layers given
    src_key_padding_mask = ids == PAD, a linear head on the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.positions = nn.Embedding(T, D)
        layer = nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        at = torch.arange(ids.shape[1], device=ids.device)
        h = self.encoder(self.tokens(ids) + self.positions(at), src_key_padding_mask=ids == PAD)
        return self.head(h[:, 0])


class SdpaAttention(nn.Module):
    """Hand-written attention through F.scaled_dot_product_attention whose boolean attn_mask
    [N, 1, 1, T] lets the keys take part where `ids != PAD` (True: attends)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, t = ids.shape
        x = self.tokens(ids)
        q, k, v = self.qkv(x).reshape(n, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        keep = (ids != PAD)[:, None, None, :]
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(y.transpose(1, 2).reshape(n, t, D)[:, 0])


class SequenceFirst(nn.Module):
    """nn.MultiheadAttention with batch_first=False called directly: its key_padding_mask is
    [N, T] either way, here `~(ids > PAD)` (a negated comparison)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.attention = nn.MultiheadAttention(D, 2)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids).transpose(0, 1)  # (T, N, D)
        y, _ = self.attention(x, x, x, key_padding_mask=~(ids > PAD), need_weights=False)
        return self.head(y[0])


class PaddedLM(nn.Module):
    """A causal language model over left-padded sequences: the square subsequent mask and
    the padding mask together (a query before its sequence's first id hides every key), a
    label per position."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.block = nn.TransformerEncoderLayer(
            D, 4, 32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids.eq(PAD)
        h = self.block(self.tokens(ids), src_mask=self.mask, src_key_padding_mask=pad)
        return self.head(h).transpose(1, 2)


class MaskedFillAttention(nn.Module):
    """nanoGPT's causal self-attention written by hand: scores masked_fill'ed with -inf where
    a tril buffer is 0, and (`padding`) where the key's id is PAD, then F.softmax."""

    def __init__(self, padding: bool, in_place: bool = False) -> None:
        super().__init__()
        self.padding, self.in_place = padding, in_place
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, t, d = x.size()
        q, k, v = self.c_attn(x).split(D, 2)
        q, k, v = (a.view(n, t, 2, d // 2).transpose(1, 2) for a in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.in_place:  # fairseq's and older Hugging Face code's form
            att.masked_fill_(self.bias[:, :, :t, :t] == 0, float("-inf"))
        else:
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        if self.padding:
            att = att.masked_fill((ids == PAD)[:, None, None, :], float("-inf"))
        y = nn.functional.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(n, t, d))


class TinyGPT(nn.Module):
    """Token and position tables, one pre-norm block of MaskedFillAttention, a head over the
    vocabulary at every position (a label per position)."""

    def __init__(self, padding: bool = False, in_place: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T, D)
        self.ln = nn.LayerNorm(D)
        self.attn = MaskedFillAttention(padding, in_place)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        x = x + self.attn(self.ln(x), ids)
        return self.head(x).transpose(1, 2)


MODELS = {"encoder": PaddedEncoder, "sdpa": SdpaAttention, "seq_first": SequenceFirst}
# the comparison each one's softmax makes of the ids to hide a key (~(ids > PAD): ids <= PAD)
HIDES = {"encoder": "eq", "sdpa": "eq", "seq_first": "le"}


def padded(n: int = 6, seed: int = 0, left: bool = False) -> np.ndarray:
    """Sequences of 1 to T ids in [1, VOCAB), padded with PAD to T on the right (on the left:
    `left`)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (n, T))
    for row, length in zip(ids, rng.integers(1, T + 1, n)):
        if left:
            row[: T - length] = PAD
        else:
            row[length:] = PAD
    return ids


def labels(n: int = 6, seed: int = 0, per_position: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed + 100)
    return rng.integers(0, VOCAB if per_position else 10, (n, T) if per_position else (n,))


def compiled(model: nn.Module, ids: np.ndarray, **options: object) -> mexc.Program:
    return mexc.compile(model, (torch.from_numpy(ids),), **options)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_gradients_match_torch_on_padded_batches(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    ids, y = padded(8), labels(8)
    prog = compiled(model, ids, rounding="nearest")
    softmaxes = prog.graph.nodes_of(Op.SOFTMAX)
    assert len(softmaxes) == (2 if name == "encoder" else 1)
    for softmax in softmaxes:
        assert (softmax.attrs.key_cmp, softmax.attrs.key_value) == (HIDES[name], PAD)
        assert softmax.inputs[1] == prog.graph.nodes_of(Op.INPUT)[0].out  # reads the ids
    assert_logits_match_torch(model, prog, padded(8, seed=1))
    got, want = integer_gradients(prog, ids, y), float_gradients(model, prog, ids, y)
    assert set(got) == set(want)
    for param in got:
        assert cosine(got[param], want[param]) >= 0.97, param


def test_the_mask_changes_the_logits_as_in_torch() -> None:
    """Attending over the padding too would move the first token's logits (torch without the
    mask): the integer logits are near torch's with the mask, not those without it."""
    torch.manual_seed(0)
    model = PaddedEncoder()
    ids = padded(8, seed=1)
    prog = compiled(model, ids, rounding="nearest")
    x = torch.from_numpy(ids)
    with torch.no_grad():
        unmasked = model.head(model.encoder(model.tokens(x) + model.positions(torch.arange(T))))
        masked = model(x).numpy()
    got = prog.logits(ids)
    rows = (ids == PAD).sum(axis=1) >= 3  # the samples the padding moves most
    near = np.abs(got - masked)[rows].mean()
    assert near < 0.3 * np.abs(got - unmasked[:, 0].numpy())[rows].mean()
    assert np.abs(got - masked).max() < 0.05 * np.abs(masked).max()


def test_hidden_keys_get_probability_zero_and_the_others_sum_to_one() -> None:
    """The softmax of the integer step: p = 0 exactly at every hidden key (here ids >= 30:
    `keep = ids < 30`), the other keys' p sum to 1 within rounding, and a row whose every key
    is hidden (a sample of hidden ids only) is 0 throughout."""

    class Ignores(SdpaAttention):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            n, t = ids.shape
            q, k, v = self.qkv(self.tokens(ids)).reshape(n, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            keep = (ids < 30).unsqueeze(1).unsqueeze(2)
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            return self.head(y.transpose(1, 2).reshape(n, t, D)[:, 0])

    torch.manual_seed(0)
    rng = np.random.default_rng(3)
    ids = rng.integers(1, VOCAB, (4, T))
    ids[0] = rng.integers(30, VOCAB, T)
    prog = compiled(Ignores(), ids)
    (softmax,) = prog.graph.nodes_of(Op.SOFTMAX)
    assert (softmax.attrs.key_cmp, softmax.attrs.key_value) == ("ge", 30)
    p = step_values(prog, ids, labels(4))[softmax.out].dequantize()  # [N, heads, T, T]
    hidden = np.broadcast_to((ids >= 30)[:, None, None, :], p.shape)
    assert hidden[1:].any() and (p[hidden] == 0).all()
    assert (p[0] == 0).all()
    assert np.abs(p[1:].sum(axis=-1) - 1).max() < 0.05


def test_a_padded_language_model_matches_torch_where_torch_is_finite() -> None:
    """Causal and padding masks together over left-padded sequences: the queries before a
    sequence's first id hide every key (torch's output there is NaN; mexc's attention gives
    0), and every other position's logits match torch's."""
    torch.manual_seed(0)
    model = PaddedLM()
    ids = padded(6, left=True)
    ids[0] = PAD  # a sequence of padding only
    prog = compiled(model, ids, rounding="nearest")
    (softmax,) = prog.graph.nodes_of(Op.SOFTMAX)
    assert bool(softmax.attrs.causal) and softmax.attrs.key_cmp == "eq"
    ref = model.double().eval()
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).numpy()
    got = prog.logits(ids)
    assert np.isfinite(got).all()
    finite = np.isfinite(want).all(axis=1)  # [N, T]: the positions torch computes
    assert finite.sum() == int((np.cumsum(ids != PAD, axis=1) > 0).sum())
    err = np.abs(got - want).max(axis=1)[finite]
    assert err.max() <= 0.05 * np.abs(want.transpose(0, 2, 1)[finite]).max()


@pytest.mark.parametrize(("padding", "in_place"), [(False, False), (True, False), (True, True)])
def test_masked_fill_attention_matches_torch(padding: bool, in_place: bool) -> None:
    """nanoGPT's masked_fill(-inf) before F.softmax (or masked_fill_): the softmax hides the
    later keys (causal) and, with the padding mask too, the PAD keys."""
    torch.manual_seed(0)
    model = TinyGPT(padding, in_place)
    ids, y = padded(6), labels(6, per_position=True)
    prog = compiled(model, ids, rounding="nearest")
    (softmax,) = prog.graph.nodes_of(Op.SOFTMAX)
    assert bool(softmax.attrs.causal)
    assert softmax.attrs.key_cmp == ("eq" if padding else "")
    assert_logits_match_torch(model, prog, padded(6, seed=1))
    got, want = integer_gradients(prog, ids, y), float_gradients(model, prog, ids, y)
    for param in got:
        assert cosine(got[param], want[param]) >= 0.99, param


def test_what_a_key_mask_cannot_be_is_refused_by_node() -> None:
    class QueryMask(SdpaAttention):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            n, t = ids.shape
            q, k, v = self.qkv(self.tokens(ids)).reshape(n, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            keep = (ids != PAD)[:, None, :, None]  # along the queries
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            return self.head(y.transpose(1, 2).reshape(n, t, D)[:, 0])

    class OtherPattern(MaskedFillAttention):
        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            att = x @ x.transpose(-2, -1)
            hidden = torch.ones(T, T, dtype=torch.bool).triu(2)  # a band, not the causal mask
            return nn.functional.softmax(att.masked_fill(hidden, float("-inf")), -1) @ x

    class AddedBand(MaskedFillAttention):
        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            att = x @ x.transpose(-2, -1) + torch.triu(torch.full((T, T), -1e4), 2)
            return nn.functional.softmax(att, -1) @ x

    class ReadsMaskedScores(MaskedFillAttention):
        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            att = (x @ x.transpose(-2, -1)).masked_fill(self.bias[0, 0] == 0, float("-inf"))
            return (att * 2.0) @ x

    class Reordered(SdpaAttention):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            n, t = ids.shape
            q, k, v = self.qkv(self.tokens(ids)).reshape(n, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            keep = (ids != PAD)[:, torch.arange(T - 1, -1, -1)][:, None, None, :]  # reversed
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            return self.head(y.transpose(1, 2).reshape(n, t, D)[:, 0])

    class MaskedOutput(SequenceFirst):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            logits = self.head(self.tokens(ids)).transpose(1, 2)  # [N, 10, T]
            return logits.masked_fill((ids == PAD)[:, None, :], float("-inf"))

    def gpt(attention: type[MaskedFillAttention]) -> TinyGPT:
        model = TinyGPT()
        model.attn = attention(False)
        return model

    ids = padded(4)
    with pytest.raises(UnsupportedOpError, match=r"hides keys by a mask \[4, 1, 8, 1\]"):
        compiled(QueryMask(), ids)
    with pytest.raises(UnsupportedOpError, match=r"'masked_fill'.*cannot apply"):
        compiled(gpt(OtherPattern), ids)
    with pytest.raises(UnsupportedOpError, match=r"'add_1'.*cannot apply"):
        compiled(gpt(AddedBand), ids)
    with pytest.raises(UnsupportedOpError, match=r"'mul'.*keys a mask hides"):
        compiled(gpt(ReadsMaskedScores), ids)
    with pytest.raises(UnsupportedOpError, match=r"'getitem.*not a tensor of indices"):
        compiled(Reordered(), ids)
    with pytest.raises(UnsupportedOpError, match=r"'masked_fill'.*model's output.*return the"):
        compiled(MaskedOutput(), ids)


class AddedCausalMask(MaskedFillAttention):
    """The causal mask added to the scores: a triu buffer of -1e4 (`finite`) or
    nn.Transformer.generate_square_subsequent_mask's -inf, then the Annotated Transformer's
    finite masked_fill of the padding."""

    def __init__(self, finite: bool) -> None:
        super().__init__(padding=True)
        self.finite = finite
        hidden = torch.triu(torch.full((T, T), -1e4), 1)
        added = hidden if finite else nn.Transformer.generate_square_subsequent_mask(T)
        self.register_buffer("added", added)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, t, d = x.size()
        q, k, v = self.c_attn(x).split(D, 2)
        q, k, v = (a.view(n, t, 2, d // 2).transpose(1, 2) for a in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))) + self.added
        att = att.masked_fill((ids == PAD)[:, None, None, :], -1e9)
        y = nn.functional.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(n, t, d))


def _gpt_with(attention: nn.Module | None, ids: np.ndarray) -> mexc.Program:
    """TinyGPT(padding=True) compiled for `ids`, its attention replaced by `attention` (with
    the same weights) where one is given."""
    torch.manual_seed(0)
    model = TinyGPT(padding=True)
    if attention is not None:
        torch.manual_seed(0)
        attention.load_state_dict(model.attn.state_dict(), strict=False)
        model.attn = attention
    return compiled(model, ids)


@pytest.mark.parametrize("finite", [True, False])
def test_an_added_causal_mask_and_a_finite_fill_hide_as_minus_inf_does(finite: bool) -> None:
    """The same program, bit for bit, as masked_fill(-inf) of both masks: before, the added
    -1e4 took the scores' one exponent (their mantissas all rounded to 0)."""
    ids = padded(6)
    ids[1] = PAD  # a row of padding only: torch's -1e9 fill makes it uniform, mexc's 0

    batch = (ids, labels(6, 0, True))
    want = train_checksums(_gpt_with(None, ids), batch)
    assert train_checksums(_gpt_with(AddedCausalMask(finite), ids), batch) == want


class WhereMasks(MaskedFillAttention):
    """The masks of MaskedFillAttention(padding=True) chosen by torch.where. `form`: the
    hidden keys filled with a full_like tensor of -inf ("tensor") or the number -inf
    ("number"), the padding with -1e9; or the kept keys named, the fill third
    (`torch.where(kept, att, -inf)`: "kept"), by the method (`att.where(kept, -inf)`:
    "method"), or with a 0-d tensor of float32's minimum (Hugging Face GPT-2's: "finfo")."""

    def __init__(self, form: str) -> None:
        super().__init__(padding=True)
        self.form = form

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, t, d = x.size()
        q, k, v = self.c_attn(x).split(D, 2)
        q, k, v = (a.view(n, t, 2, d // 2).transpose(1, 2) for a in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        hidden, kept = self.bias[:, :, :t, :t] == 0, self.bias[:, :, :t, :t].bool()
        padding, tokens = (ids == PAD)[:, None, None, :], (ids != PAD)[:, None, None, :]
        if self.form in ("tensor", "number"):
            fill = torch.full_like(att, float("-inf")) if self.form == "tensor" else -math.inf
            att = torch.where(padding, -1e9, torch.where(hidden, fill, att))
        elif self.form == "kept":
            att = torch.where(tokens, torch.where(kept, att, -math.inf), -1e9)
        elif self.form == "method":
            att = att.where(kept, -math.inf).where(tokens, -math.inf)
        else:
            lowest = torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype)
            att = torch.where(tokens, torch.where(kept, att, lowest), lowest)
        y = nn.functional.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(n, t, d))


@pytest.mark.parametrize("form", ["tensor", "number", "kept", "method", "finfo"])
def test_masks_chosen_by_torch_where_hide_as_masked_fill_does(form: str) -> None:
    """torch.where(mask, -inf, scores) is scores.masked_fill(mask, -inf), and
    torch.where(kept, scores, -inf) is scores.masked_fill(~kept, -inf): the same program, bit
    for bit (the first was refused: the number -inf as a fill, a tensor of -inf as a division;
    the second, with a number, refused too, and with finfo.min computed as a blend of the
    scores and the fill)."""
    ids = padded(6)

    batch = (ids, labels(6, 0, True))
    want = train_checksums(_gpt_with(None, ids), batch)
    assert train_checksums(_gpt_with(WhereMasks(form), ids), batch) == want


# the forms lower to one softmax with a key mask: the encoder (two layers, the padding mask
# alone), the padded language model (with the causal mask, all-padding rows) and the masked_fill
# of both (the frontend's other path to the same op)
def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    ids = padded(6)
    ids[1] = PAD

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return compiled(PaddedEncoder(), ids, target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, (ids, labels(6)))

    lm_ids = padded(6, left=True)

    def lm(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return compiled(PaddedLM(), lm_ids, target=target)

    assert_trains_bit_exact_on_llvm_and_c(lm("reference"), lm, (lm_ids, labels(6, 0, True)))

    def gpt(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return compiled(TinyGPT(padding=True), ids, target=target)

    assert_trains_bit_exact_on_llvm_and_c(gpt("reference"), gpt, (ids, labels(6, 0, True)))


@needs_cuda_tools
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = padded(4, left=True)
    ids[2] = PAD
    assert_cuda_source_trains_bit_exact(compiled(PaddedLM(), ids), tmp_path)


def test_digits_sparse_are_the_nonzero_pixels_of_the_digits_padded() -> None:
    from mexc.data import SPARSE_CLS, SPARSE_LENGTH, SPARSE_PAD, get_dataset

    x, y = get_dataset("digits-sparse", "test")
    tokens, labels = get_dataset("digits-tokens", "test")
    assert x.shape == (297, SPARSE_LENGTH) and x.dtype == np.int64
    assert np.array_equal(y, labels) and (x[:, 0] == SPARSE_CLS).all()
    lengths = (x != SPARSE_PAD).sum(axis=1)
    assert (x[np.arange(SPARSE_LENGTH) >= lengths[:, None]] == SPARSE_PAD).all()  # padded
    assert np.array_equal(lengths - 1, (tokens > 0).sum(axis=1))
    pixels = x[:, 1:][x[:, 1:] != SPARSE_PAD]
    assert pixels.min() >= 2 and pixels.max() < 2 + 4 * 64
    # every id names its pixel and level, in row-major order
    image = tokens[5]
    (at,) = np.nonzero(image)
    assert np.array_equal(x[5, 1 : 1 + at.size], 2 + 4 * at + (image[at] - 1) // 4)
