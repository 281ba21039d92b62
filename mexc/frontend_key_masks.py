"""Masks a forward computes from its token ids (`ids == pad`), followed to the attention that
reads them as key masks.

A comparison of the integer input with a constant is not an op of the program: the frontend
records it as a KeyMask (mexc.ops.attention), follows it through negations, boolean casts and
views that only insert or drop axes of extent 1, and the attention converters turn it into the
softmax's key mask, which reads the ids themselves (docs/layers.md, "Key-masked softmax"). Any
other read of such a mask is refused by node (frontend._Ctx.arg).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from mexc.ops.attention import KeyMask
from mexc.ops.common import static_value

_COMPARISONS: dict[Any, str] = {
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    torch.eq: "eq",
    torch.ne: "ne",
    torch.lt: "lt",
    torch.le: "le",
    torch.gt: "gt",
    torch.ge: "ge",
}
_METHOD_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}
# `value cmp ids` is `ids cmp' value`
_SWAPPED = {"eq": "eq", "ne": "ne", "lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}
_NEGATIONS = {operator.invert, torch.logical_not, torch.bitwise_not}
_METHOD_NEGATIONS = {"logical_not", "bitwise_not"}
# casts that change nothing of a boolean mask (its dtype is checked: bool)
_CASTS = {"bool", "to", "contiguous"}
# broadcasts: the mask keeps its shape, and only the attention may read it then
_EXPANDS = {"expand", "expand_as"}
# views that keep the mask's elements in order where its axes of extent 1 alone change
_METHOD_VIEWS = {"unsqueeze", "view", "reshape"}
_VIEWS = {operator.getitem, torch.unsqueeze, torch.reshape}


def key_mask_of(c: Any, n: torch.fx.Node) -> KeyMask | None:
    """The KeyMask node n computes from the token ids or from another KeyMask, or None where
    it computes something else (then converted, or refused, as any node)."""
    if n.op not in ("call_function", "call_method") or not n.args:
        return None
    meta = n.meta.get("tensor_meta")
    if meta is None or getattr(meta, "dtype", None) is not torch.bool:
        return None
    shape = tuple(int(d) for d in meta.shape)
    kind: Any = n.target if n.op == "call_function" else str(n.target)
    first = n.args[0]
    if kind in _COMPARISONS or kind in _METHOD_COMPARISONS:
        cmp = str(_COMPARISONS.get(kind, kind))
        other = n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
        value = _constant(other)
        if c.is_token_ids(first) and value is not None:
            return KeyMask(cmp, value, shape, shape)
        value = _constant(first)
        if c.is_token_ids(other) and n.op == "call_function" and value is not None:
            return KeyMask(_SWAPPED[cmp], value, shape, shape)
        return None
    mask = c.env.get(first) if isinstance(first, torch.fx.Node) else None
    if not isinstance(mask, KeyMask):
        return None
    if kind in _NEGATIONS or kind in _METHOD_NEGATIONS:
        return mask.negated()
    if kind in _CASTS:
        return mask
    if mask.expanded:  # a broadcast only feeds the attention (an index of it may reorder)
        return None
    if kind in _EXPANDS:
        return dataclasses.replace(mask, expanded=True)
    if kind is operator.getitem and not _inserts_axes(n.args[1]):
        return None
    if (kind in _VIEWS or kind in _METHOD_VIEWS) and _squeezed(shape) == _squeezed(mask.shape):
        return KeyMask(mask.cmp, mask.value, shape, mask.ids)
    return None


def _inserts_axes(index: Any) -> bool:
    """An index that only inserts axes of extent 1 and keeps every element in place: None,
    `...` and whole slices `:` (mask[:, None, None, :])."""
    items = index if isinstance(index, tuple) else (index,)
    whole = slice(None, None, None)
    return all(i is None or i is Ellipsis or i == whole for i in items)


def _constant(a: Any) -> int | None:
    """a as a Python integer the int32 ids can be compared with, where it is one (a bool is
    not)."""
    v = static_value(a)
    if not isinstance(v, int) or isinstance(v, bool) or not -(1 << 31) <= v < 1 << 31:
        return None
    return int(v)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)
