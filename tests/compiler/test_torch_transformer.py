"""torch's own transformer modules (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, their
stacks, nn.Transformer) traced through mexc's forward of them (mexc.frontend_modules), and
nn.MultiheadAttention sequence-first and over another sequence (a decoder's memory), and causal
attention (is_causal, the square subsequent mask). Against torch and autograd, bit-exact on
reference, llvm and C; other masks and samples attended across the batch refused by node."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import InputError, UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    step_values,
)

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")

D, HEADS, FF = 16, 4, 32


class Encoder(nn.Module):
    """A classifier over (N, 6, D) tokens: a 2-layer nn.TransformerEncoder, mean over tokens."""

    def __init__(self, batch_first: bool = True, **options: object) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, batch_first=batch_first, **options)
        norm = nn.LayerNorm(D) if options.get("norm_first") else None
        self.encoder = nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False)
        self.batch_first = batch_first
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return self.fc(self.encoder(x).mean(1))
        return self.fc(self.encoder(x.transpose(0, 1)).mean(0))  # (T, N, D), over time


class Seq2Seq(nn.Module):
    """nn.Transformer: the encoder reads all 6 tokens, the decoder the first 4 and attends to
    the encoder's memory (cross-attention over another number of tokens)."""

    def __init__(self, batch_first: bool = True, **options: object) -> None:
        super().__init__()
        self.t = nn.Transformer(D, HEADS, 1, 2, FF, batch_first=batch_first, **options)
        self.batch_first = batch_first
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return self.fc(self.t(x, x[:, :4]).mean(1))
        seq = x.transpose(0, 1)
        return self.fc(self.t(seq, seq[:4]).mean(0))


class Decoder(nn.Module):
    """nn.TransformerDecoder alone, its memory a projection of the input."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(D, HEADS, FF, batch_first=True, activation="gelu")
        self.decoder = nn.TransformerDecoder(layer, 1)
        self.memory = nn.Linear(D, D)
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.decoder(x, self.memory(x)).mean(1))


class Causal(nn.Module):
    """Each token attends to itself and the tokens before it: nn.Transformer's square
    subsequent mask given to the encoder (a buffer), F.scaled_dot_product_attention's
    is_causal, or the mask made in forward and given to the decoder of nn.Transformer."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        if how == "encoder_mask":
            layer = nn.TransformerEncoderLayer(D, HEADS, FF, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        elif how.startswith("sdpa"):
            self.qkv = nn.Linear(D, 3 * D)
        else:
            self.t = nn.Transformer(D, HEADS, 1, 1, FF, batch_first=True)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(6))
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "encoder_mask":
            y = self.encoder(x, mask=self.mask, is_causal=True)
        elif self.how.startswith("sdpa"):
            q, k, v = self.qkv(x).reshape(-1, 6, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
            causal = self.how == "sdpa_is_causal"
            mask = self.mask[None] if self.how == "sdpa_mask_leading_axis" else None
            y = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal
            )
            y = y.transpose(1, 2).reshape(-1, 6, D)
        elif self.how == "transformer_target":
            y = self.t(x, x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(6))
        else:  # the masks by position: src_mask None, tgt_mask the buffer
            y = self.t(x, x, None, self.mask)
        return self.fc(y.mean(1))


class Subclass(nn.TransformerEncoderLayer):
    """A subclass that keeps torch's forward and overrides its feed-forward block."""

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.linear2(self.activation(self.linear1(x))) * 2.0)


class SubclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Subclass(D, HEADS, FF, batch_first=True, activation=nn.GELU())
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer(x).mean(1))


CASES = {
    "encoder": lambda: Encoder(),
    "encoder_norm_first_gelu": lambda: Encoder(norm_first=True, activation="gelu"),
    "encoder_sequence_first": lambda: Encoder(batch_first=False),
    "transformer": lambda: Seq2Seq(),
    "transformer_sequence_first_norm_first": lambda: Seq2Seq(False, norm_first=True),
    "decoder": Decoder,
    "subclass": SubclassModel,
    "causal_encoder_mask": lambda: Causal("encoder_mask"),
    "causal_sdpa": lambda: Causal("sdpa_is_causal"),
    "causal_transformer_target": lambda: Causal("transformer_target"),
    "causal_masks_by_position": lambda: Causal("masks_by_position"),
    "causal_mask_with_a_leading_axis": lambda: Causal("sdpa_mask_leading_axis"),
}


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[case]()


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 6, D)).astype(np.float32), rng.integers(0, 10, batch)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_torch(case: str) -> None:
    model = _model(case)
    prog = mexc.compile(model, (torch.zeros(8, 6, D),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


def test_the_layers_become_their_submodules_ops() -> None:
    prog = mexc.compile(_model("transformer"), (torch.zeros(2, 6, D),))
    g = prog.graph
    # 5 attentions: the encoder layer's, and each of the 2 decoder layers' self- and
    # cross-attention
    assert sum(n.op is Op.SOFTMAX for n in g.nodes) == 5
    readers = {str(n.attrs.name): 0 for n in g.nodes_of(Op.PARAM)}
    param_of = {n.out: str(n.attrs.name) for n in g.nodes_of(Op.PARAM)}
    for n in g.nodes:  # the forward's products with a weight (a LINEAR, maybe fused)
        if n.op.value.startswith("linear") and "grad" not in n.op.value:
            readers[param_of[n.inputs[1]]] += 1
    # a self-attention projects its tokens once; the cross-attention projects the decoder's
    # tokens and the memory, each by the whole in_proj_weight
    for i in range(2):
        layer = f"t.decoder.layers.{i}"
        assert readers[f"{layer}.self_attn.in_proj_weight"] == 1
        assert readers[f"{layer}.multihead_attn.in_proj_weight"] == 2
    assert "t.encoder.norm.weight" in readers and "t.decoder.norm.weight" in readers


@pytest.mark.parametrize(
    ("make", "attention"),
    [
        (lambda: Seq2Seq(dropout=0.0), "t.decoder.layers.0.multihead_attn"),
        (lambda: Encoder(False, dropout=0.0), "encoder.layers.0.self_attn"),
    ],
    ids=["cross_attention", "sequence_first"],
)
def test_gradients_match_autograd(make: Any, attention: str) -> None:
    # without dropout: torch's masks and the program's differ (at 0.1, cosines 0.7 to 0.95)
    torch.manual_seed(0)
    model = make()
    prog = mexc.compile(model, (torch.zeros(64, 6, D),))
    x, y = _data(64)
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    for name in (f"{attention}.in_proj_weight", f"{attention}.out_proj.weight", "fc.weight"):
        assert cosine(got[name], want[name]) >= 0.99, (name, cosine(got[name], want[name]))
    # the query's, key's and value's rows, each from its own slice of the projections
    g, w = got[f"{attention}.in_proj_weight"], want[f"{attention}.in_proj_weight"]
    for i in range(3):
        rows = slice(i * D, (i + 1) * D)
        assert cosine(g[rows], w[rows]) >= 0.96, (i, cosine(g[rows], w[rows]))


@pytest.mark.parametrize("case", ["transformer", "causal_transformer_target"])
def test_trains_bit_exact_on_reference_llvm_and_c(case: str) -> None:
    def program(target: str = "reference") -> mexc.Program:
        return mexc.compile(_model(case), (torch.zeros(2, 6, D),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program(), program, _data(2))


def test_a_causal_mask_hides_the_later_tokens() -> None:
    """The causal softmax's probabilities are 0 after the diagonal and its rows still sum to
    about 1; the mask changes the logits (against the same model without it)."""
    prog = mexc.compile(_model("causal_sdpa"), (torch.zeros(8, 6, D),), rounding="nearest")
    (node,) = [n for n in prog.graph.nodes if n.op is Op.SOFTMAX]
    assert bool(node.attrs.causal)
    p = step_values(prog, *_data(8))[node.out]
    probs = p.m.astype(np.int64)
    assert (probs[..., np.triu_indices(6, 1)[0], np.triu_indices(6, 1)[1]] == 0).all()
    assert np.abs(probs.sum(-1) * 2.0 ** float(p.e) - 1).max() < 0.05
    plain = Causal("sdpa_is_causal")
    plain.how = "sdpa_without_mask"
    other = mexc.compile(plain, (torch.zeros(8, 6, D),), rounding="nearest")
    x = _data(8)[0]
    assert cosine(prog.logits(x), other.logits(x)) < 0.99


class Masked(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(D, HEADS, FF, batch_first=True), 1,
            enable_nested_tensor=False,
        )  # fmt: skip
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(6))
        self.register_buffer("padding", torch.arange(6).expand(2, 6) > 3)
        self.how = how
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "anticausal":  # each token attends to itself and the later ones
            y = self.encoder(x, mask=self.causal.T)
        elif self.how == "padding":
            y = self.encoder(x, src_key_padding_mask=self.padding)
        else:  # -inf entries given to scaled_dot_product_attention: the first key hidden
            q = x.reshape(-1, 6, HEADS, D // HEADS).transpose(1, 2)
            hide_first = torch.zeros(6, 6).index_fill(1, torch.tensor([0]), float("-inf"))
            y = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=hide_first)
            y = y.transpose(1, 2).reshape(-1, 6, D)
        return self.fc(y.mean(1))


@pytest.mark.parametrize(
    ("how", "node"),
    [
        ("anticausal", "encoder.layers.0.self_attn"),
        ("padding", "encoder.layers.0.self_attn"),
        ("minus_infinity", "scaled_dot_product_attention"),
    ],
)
def test_masks_are_refused_by_node(how: str, node: str) -> None:
    where = f"{node}.*test_torch_transformer.py.*cannot apply"
    with pytest.raises(UnsupportedOpError, match=where):
        mexc.compile(Masked(how), (torch.zeros(2, 6, D),))


class BatchFirstIntoSequenceFirst(nn.Module):
    """(N, T, D) given to a layer built with batch_first=False: torch attends across the
    samples."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, HEADS, FF)
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer(x).mean(1))


def test_attention_across_the_batch_is_refused_by_node() -> None:
    with pytest.raises(UnsupportedOpError, match=r"layer_self_attn.*across the batch axis"):
        mexc.compile(BatchFirstIntoSequenceFirst(), (torch.zeros(2, 6, D),))


def test_separate_key_and_value_sizes_are_refused_by_node() -> None:
    class Kdim(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(D, HEADS, kdim=8, vdim=8, batch_first=True)
            self.fc = nn.Linear(D, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.attn(x, x[..., :8], x[..., :8])[0].mean(1))

    with pytest.raises(UnsupportedOpError, match="'attn'.*kdim or vdim"):
        mexc.compile(Kdim(), (torch.zeros(2, 6, D),))


def test_a_non_finite_parameter_is_refused_by_name() -> None:
    model = _model("encoder")
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    with pytest.raises(InputError, match="'fc.weight' holds 1 NaN"):
        mexc.compile(model, (torch.zeros(2, 6, D),))
