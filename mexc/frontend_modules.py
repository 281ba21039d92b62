"""Modules mexc traces through a forward of its own: torch's transformer layers.

`nn.TransformerEncoderLayer`, `nn.TransformerDecoderLayer`, the `nn.TransformerEncoder` and
`nn.TransformerDecoder` stacks and `nn.Transformer` decide in Python, on the tensors' values and
on global state, whether to take a fused inference kernel (`src.is_nested`,
`torch.is_grad_enabled()`, the masks' contents), which symbolic tracing cannot follow. The
forwards below are their unfused path (torch's own, less the checks), written against the
modules' submodules and blocks (`_sa_block`, `_ff_block`, `_mha_block`, `norm1`, `layers`,
`norm`): traced, every submodule becomes its own node, converted by its own pattern
(MultiheadAttention, Linear, LayerNorm, Dropout, the activation), with the submodule's name in
any error. Masks and
`is_causal` are passed on to the attention, which takes the causal mask and padding masks of the
token ids (`src_key_padding_mask = ids == pad`) and refuses the others by node.

A subclass that keeps torch's `forward` is traced as its class, through the blocks it may
override; one that overrides `forward` is traced through its own, as any user module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

# the arguments each forward below reads, by the names of torch's forward (bound to its
# signature, so a model may pass them by position)
Args = dict[str, Any]
_DECODER_MASKS = ("tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask")


def _encoder_layer(m: nn.TransformerEncoderLayer, a: Args) -> Any:
    # the blocks are the layer's own methods, so a subclass that overrides one (and keeps
    # forward) is traced as torch trains it
    def attend(x: Any) -> Any:
        return m._sa_block(x, a["src_mask"], a["src_key_padding_mask"], is_causal=a["is_causal"])

    x = a["src"]
    if m.norm_first:
        x = x + attend(m.norm1(x))
        return x + m._ff_block(m.norm2(x))
    x = m.norm1(x + attend(x))
    return m.norm2(x + m._ff_block(x))


def _decoder_layer(m: nn.TransformerDecoderLayer, a: Args) -> Any:
    def attend(x: Any) -> Any:
        return m._sa_block(x, a["tgt_mask"], a["tgt_key_padding_mask"], a["tgt_is_causal"])

    def cross(x: Any) -> Any:
        mem = a["memory"]
        masks = a["memory_mask"], a["memory_key_padding_mask"], a["memory_is_causal"]
        return m._mha_block(x, mem, *masks)

    x = a["tgt"]
    if m.norm_first:
        x = x + attend(m.norm1(x))
        x = x + cross(m.norm2(x))
        return x + m._ff_block(m.norm3(x))
    x = m.norm1(x + attend(x))
    x = m.norm2(x + cross(x))
    return m.norm3(x + m._ff_block(x))


def _encoder(m: nn.TransformerEncoder, a: Args) -> Any:
    out = a["src"]
    for layer in m.layers:
        out = layer(
            out,
            src_mask=a["mask"],
            src_key_padding_mask=a["src_key_padding_mask"],
            is_causal=bool(a["is_causal"]),
        )
    return m.norm(out) if m.norm is not None else out


def _decoder(m: nn.TransformerDecoder, a: Args) -> Any:
    out = a["tgt"]
    masks = {k: a[k] for k in _DECODER_MASKS}
    for layer in m.layers:
        causal = {"tgt_is_causal": bool(a["tgt_is_causal"])}
        out = layer(out, a["memory"], **masks, **causal, memory_is_causal=a["memory_is_causal"])
    return m.norm(out) if m.norm is not None else out


def _transformer(m: nn.Transformer, a: Args) -> Any:
    memory = m.encoder(
        a["src"],
        mask=a["src_mask"],
        src_key_padding_mask=a["src_key_padding_mask"],
        is_causal=a["src_is_causal"],
    )
    rest = {k: a[k] for k in (*_DECODER_MASKS, "tgt_is_causal", "memory_is_causal")}
    return m.decoder(a["tgt"], memory, **rest)


# torch's class -> the forward mexc traces in its place
_FORWARDS: dict[type[nn.Module], Callable[[Any, Args], Any]] = {
    nn.TransformerEncoderLayer: _encoder_layer,
    nn.TransformerDecoderLayer: _decoder_layer,
    nn.TransformerEncoder: _encoder,
    nn.TransformerDecoder: _decoder,
    nn.Transformer: _transformer,
}


def traced_forward(m: nn.Module) -> Callable[..., Any] | None:
    """The forward mexc traces for `m` instead of its own, or None for m's own."""
    base = next((t for t in type(m).__mro__ if t in _FORWARDS), None)
    if base is None or type(m).forward is not base.forward:
        return None
    body = _FORWARDS[base]
    signature = inspect.signature(base.forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(m, *args, **kwargs)
        bound.apply_defaults()
        return body(m, dict(bound.arguments))

    return forward
