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
`is_causal` are passed on to the attention, which takes the causal mask and refuses the others
by node.

A subclass that keeps torch's `forward` is traced as its class, through the blocks it may
override; one that overrides `forward` is traced through its own, as any user module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def _encoder_layer(
    m: nn.TransformerEncoderLayer,
    src: Any,
    src_mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool = False,
) -> Any:
    # the blocks are the layer's own methods, so a subclass that overrides one (and keeps
    # forward) is traced as torch trains it
    x = src
    if m.norm_first:
        x = x + m._sa_block(m.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + m._ff_block(m.norm2(x))
    x = m.norm1(x + m._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
    return m.norm2(x + m._ff_block(x))


def _decoder_layer(
    m: nn.TransformerDecoderLayer,
    tgt: Any,
    memory: Any,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    tgt_is_causal: bool = False,
    memory_is_causal: bool = False,
) -> Any:
    def attend(x: Any) -> Any:
        return m._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal)

    def cross(x: Any) -> Any:
        return m._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal)

    x = tgt
    if m.norm_first:
        x = x + attend(m.norm1(x))
        x = x + cross(m.norm2(x))
        return x + m._ff_block(m.norm3(x))
    x = m.norm1(x + attend(x))
    x = m.norm2(x + cross(x))
    return m.norm3(x + m._ff_block(x))


def _encoder(
    m: nn.TransformerEncoder,
    src: Any,
    mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool | None = None,
) -> Any:
    out = src
    for layer in m.layers:
        out = layer(
            out,
            src_mask=mask,
            src_key_padding_mask=src_key_padding_mask,
            is_causal=bool(is_causal),
        )
    return m.norm(out) if m.norm is not None else out


def _decoder(
    m: nn.TransformerDecoder,
    tgt: Any,
    memory: Any,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> Any:
    out = tgt
    for layer in m.layers:
        out = layer(
            out,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=bool(tgt_is_causal),
            memory_is_causal=memory_is_causal,
        )
    return m.norm(out) if m.norm is not None else out


def _transformer(
    m: nn.Transformer,
    src: Any,
    tgt: Any,
    src_mask: Any = None,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    src_key_padding_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    src_is_causal: bool | None = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> Any:
    memory = m.encoder(
        src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
    )
    return m.decoder(
        tgt,
        memory,
        tgt_mask=tgt_mask,
        memory_mask=memory_mask,
        tgt_key_padding_mask=tgt_key_padding_mask,
        memory_key_padding_mask=memory_key_padding_mask,
        tgt_is_causal=tgt_is_causal,
        memory_is_causal=memory_is_causal,
    )


# torch's class -> the forward mexc traces in its place
_FORWARDS: dict[type, Callable[..., Any]] = {
    nn.TransformerEncoderLayer: _encoder_layer,
    nn.TransformerDecoderLayer: _decoder_layer,
    nn.TransformerEncoder: _encoder,
    nn.TransformerDecoder: _decoder,
    nn.Transformer: _transformer,
}


def traced_forward(m: nn.Module) -> Callable[..., Any] | None:
    """The forward mexc traces for `m` instead of its own, or None for m's own."""
    base = next((t for t in type(m).__mro__ if t in _FORWARDS), None)
    if base is None or type(m).forward is not getattr(base, "forward", None):
        return None
    body = _FORWARDS[base]
    return lambda *args, **kwargs: body(m, *args, **kwargs)
