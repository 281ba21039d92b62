"""Masks a forward computes from its token ids (`ids == pad`), followed to the attention that
reads them as key masks, or read as tensors of 0 and 1.

A comparison of the integer input with a constant is not an op of the program: the frontend
records it as a KeyMask (mexc.ops.attention), follows it through negations, boolean casts and
views that only insert or drop axes of extent 1, and the attention converters turn it into the
softmax's key mask, which reads the ids themselves (docs/layers.md, "Key-masked softmax"). Any
other read of such a mask (`h * mask[..., None]`, `mask.float()`, `mask.sum(1)`: a masked mean)
reads it as an activation (`as_activation`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mexc.errors import UnsupportedOpError
from mexc.ir import Op, Value
from mexc.kernels.transformer import KEY_CMPS, key_hidden
from mexc.ops.attention import HIDING, KeyMask, MaskedScores, is_causal_mask, key_mask
from mexc.ops.common import static_value
from mexc.ops.gather import static_tensor
from mexc.ops.tensor import MAX_FILL, broadcast, reshaped

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
# casts that change nothing of a boolean mask (its dtype is checked: bool), and casts to float
_CASTS = {"bool", "to", "contiguous"}
_FLOAT_CASTS = {"float", "double", "half", "to", "type", "type_as", "contiguous"}
# broadcasts: the mask keeps its shape (the node's is broadcast)
_EXPANDS = {"expand", "expand_as"}
# views that keep the mask's elements in order where its axes of extent 1 alone change
_METHOD_VIEWS = {"unsqueeze", "view", "reshape"}
_VIEWS = {operator.getitem, torch.unsqueeze, torch.reshape}
# a float mask with a number: the result's value where the comparison holds, and elsewhere
_ARITHMETIC: dict[Any, Callable[[float, float], float]] = {
    operator.add: operator.add,
    torch.add: operator.add,
    "add": operator.add,
    operator.sub: operator.sub,
    torch.sub: operator.sub,
    "sub": operator.sub,
    torch.rsub: lambda a, b: b - a,
    "rsub": lambda a, b: b - a,
    operator.mul: operator.mul,
    torch.mul: operator.mul,
    "mul": operator.mul,
    operator.truediv: operator.truediv,
    torch.div: operator.truediv,
    torch.true_divide: operator.truediv,
    "div": operator.truediv,
    "true_divide": operator.truediv,
}
_NEGATE = {operator.neg, torch.neg, "neg"}


def key_mask_of(c: Any, n: torch.fx.Node) -> KeyMask | None:
    """The KeyMask node n computes from the token ids or from another KeyMask, or None where
    it computes something else (then converted as any node: a KeyMask it reads is read as a
    tensor, as_activation)."""
    if n.op not in ("call_function", "call_method") or not n.args:
        return None
    meta = n.meta.get("tensor_meta")
    dtype = getattr(meta, "dtype", None)
    if meta is None or (dtype is not torch.bool and not getattr(dtype, "is_floating_point", False)):
        return None
    shape = tuple(int(d) for d in meta.shape)
    kind: Any = n.target if n.op == "call_function" else str(n.target)
    first = n.args[0]
    if dtype is torch.bool and (kind in _COMPARISONS or kind in _METHOD_COMPARISONS):
        return _comparison(c, n, str(_COMPARISONS.get(kind, kind)), shape)
    mask = _key_mask(c, first)
    if dtype is not torch.bool and mask is None:
        return _arithmetic(c, n, kind)
    if mask is None:
        return None
    if dtype is torch.bool and (kind in _NEGATIONS or kind in _METHOD_NEGATIONS):
        return mask.negated() if mask.boolean else None
    if kind in (_CASTS if dtype is torch.bool else _FLOAT_CASTS):
        if dtype is not torch.bool:
            return dataclasses.replace(mask, boolean=False)
        return mask if mask.boolean else _compared(mask, "ne", 0.0)
    if dtype is not torch.bool and (kind in _ARITHMETIC or kind in _NEGATE):
        return _arithmetic(c, n, kind)
    if dtype is not torch.bool and kind in _MASKED_FILLS:
        return _filled(c, n, mask)
    if mask.expanded:  # a broadcast only feeds the attention (an index of it may reorder)
        return None
    if kind in _EXPANDS:
        return dataclasses.replace(mask, expanded=True)
    if kind is operator.getitem and not _inserts_axes(n.args[1]):
        return None
    if (kind in _VIEWS or kind in _METHOD_VIEWS) and _squeezed(shape) == _squeezed(mask.shape):
        return dataclasses.replace(mask, shape=shape)
    return None


def _key_mask(c: Any, a: Any) -> KeyMask | None:
    v = c.env.get(a) if isinstance(a, torch.fx.Node) else None
    return v if isinstance(v, KeyMask) else None


def _comparison(c: Any, n: torch.fx.Node, cmp: str, shape: tuple[int, ...]) -> KeyMask | None:
    """`ids cmp value`, `value cmp ids`, or a KeyMask compared with a number (`mask == 0`)."""
    first = n.args[0]
    other = n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
    value = _constant(other)
    if c.is_token_ids(first) and value is not None:
        return KeyMask(cmp, value, shape, shape)
    value = _constant(first)
    if c.is_token_ids(other) and n.op == "call_function" and value is not None:
        return KeyMask(_SWAPPED[cmp], value, shape, shape)
    mask, number = _key_mask(c, first), _number(other)
    if mask is None and n.op == "call_function":
        mask, number, cmp = _key_mask(c, other), _number(first), _SWAPPED[cmp]
    if mask is None or number is None or mask.expanded:
        return None
    compared = _compared(mask, cmp, number)
    return None if compared is None else dataclasses.replace(compared, shape=shape)


def _compared(mask: KeyMask, cmp: str, number: float) -> KeyMask | None:
    """KeyMask `mask` compared with `number`: the same comparison of the ids or its negation,
    None where the result is the same everywhere."""
    holds, elsewhere = (bool(KEY_CMPS[cmp](v, number)) for v in (mask.on, mask.off))
    if holds == elsewhere:
        return None
    base = mask if holds else mask.negated()
    return dataclasses.replace(base, boolean=True, on=1.0, off=0.0)


def _arithmetic(c: Any, n: torch.fx.Node, kind: Any) -> KeyMask | None:
    """A KeyMask and a number combined (`1.0 - mask`, `mask * -10000.0`, `-mask`): a float
    mask with the results where the comparison holds and elsewhere."""
    if kind in _NEGATE:
        mask = _key_mask(c, n.args[0])
        if mask is None:
            return None
        return dataclasses.replace(mask, boolean=False, on=0.0 - mask.on, off=0.0 - mask.off)
    f = _ARITHMETIC.get(kind)
    if f is None or len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    mask, number = _key_mask(c, a), _number(b)
    if mask is None:
        mask, number = _key_mask(c, b), _number(a)
        f = _swapped_args(f)
    if mask is None or number is None:
        return None
    try:
        on, off = f(mask.on, number), f(mask.off, number)
    except ZeroDivisionError:
        return None
    if math.isnan(on) or math.isnan(off):
        return None
    # + 0.0: no -0.0 (it prints as -0 in messages)
    return dataclasses.replace(mask, boolean=False, on=float(on) + 0.0, off=float(off) + 0.0)


_MASKED_FILLS = {"masked_fill", torch.masked_fill}


def _filled(c: Any, n: torch.fx.Node, mask: KeyMask) -> KeyMask | None:
    """A float mask of the ids filled where a boolean mask of the same comparison (or its
    negation) holds (Hugging Face's `inverted.masked_fill(inverted.to(torch.bool),
    torch.finfo(dtype).min)`): the filled side's value replaced."""
    args = dict(zip(("input", "mask", "value"), n.args)) | dict(n.kwargs)
    where, number = _key_mask(c, args.get("mask")), _number(args.get("value"))
    if where is None or number is None or not where.boolean or where.value != mask.value:
        return None
    if where.cmp == mask.cmp:
        return dataclasses.replace(mask, on=number)
    if where.cmp == mask.negated().cmp:
        return dataclasses.replace(mask, off=number)
    return None


def _swapped_args(f: Callable[[float, float], float]) -> Callable[[float, float], float]:
    return lambda x, y: f(y, x)


def _number(a: Any) -> float | None:
    """a as a Python number (a bool counts as 0 or 1, as torch reads it), where it is one."""
    v = static_value(a)
    return float(v) if isinstance(v, (int, float)) else None


def as_activation(c: Any, a: torch.fx.Node, mask: KeyMask) -> Value:
    """KeyMask `mask` (fx node `a`'s) read as a tensor: `on` where the comparison holds (1 for
    a boolean mask), else `off` (0). An `embedding` of the ids in a constant table of one
    column holding those values for each id j of the vocabulary (its rows are filled by
    `fill_tables`, once the vocabulary is known), seen as the mask's shape and broadcast where
    it was expanded. No gradient flows into it (a constant), as torch's comparison. Values
    above MAX_FILL in size are refused: they would take the one exponent of what they meet
    (`scores + (1 - mask) * -1e4` hides keys instead: masked_scores)."""
    if ("id mask", a) in c.memo:
        return c.memo[("id mask", a)]
    if max(abs(mask.on), abs(mask.off)) > MAX_FILL:
        raise UnsupportedOpError(
            c.describe(
                c.node if c.node is not None else a,
                f"reads a mask of the token ids holding {mask.on:g} and {mask.off:g} as a "
                "tensor; mexc hides attention keys with such a mask where it is added to the "
                f"scores before their softmax (at most {HIDING:g} where hidden, 0 elsewhere), "
                f"and reads it otherwise with values of at most {MAX_FILL:g} in size",
            )
        )
    shape = tuple(c.shape(a))
    key = ("id mask rows", mask.cmp, mask.value, mask.on, mask.off)
    rows = c.memo.get(key)
    if rows is None:
        name = f"id_mask_{mask.cmp}_{mask.value}".replace("-", "m")  # ids < -1: lt_m1
        table = c.constant(name, np.zeros((1, 1)), "weight")
        c.id_masks[table] = (mask.cmp, mask.value, mask.on, mask.off)
        rows = c.emit_as(Op.EMBEDDING, [c.ids, table], (*mask.ids, 1), padding_idx=-1)
        c.memo[key] = rows
    v = reshaped(c, rows, mask.shape)
    if shape != mask.shape:
        v = broadcast(c, a, v, mask.shape, shape)
    c.memo[("id mask", a)] = v
    return v


def masked_scores(c: Any, n: torch.fx.Node) -> MaskedScores | None:
    """`scores + mask` (either order) with `mask` a float KeyMask that hides keys (Hugging
    Face's `(1.0 - mask) * -10000.0` or `* torch.finfo(dtype).min`, shaped [N, 1, 1, T] for
    scores [N, H, T, T]): the scores with those keys hidden from the softmax that reads them,
    as a masked_fill with -inf hides them (MaskedScores), or None where n is not that."""
    kind: Any = n.target if n.op == "call_function" else str(n.target)
    if kind not in (operator.add, torch.add, "add") or len(n.args) != 2 or n.kwargs:
        return None
    causal = _causal_added(c, n)
    if causal is not None:
        return causal
    for m, x in (n.args, reversed(n.args)):
        mask = _key_mask(c, m)
        if mask is None or mask.hiding() is None or not isinstance(x, torch.fx.Node):
            continue
        held = c.env.get(x)
        shape = tuple(c.shape(n))
        if not isinstance(held, (Value, MaskedScores)) or tuple(c.shape(x)) != shape:
            return None
        if not _along_keys(mask, shape):  # not attention's scores: a sum, frontend_mask_bounds
            return None
        keys = key_mask(c, n, m, shape, hides=True)
        base = held if isinstance(held, MaskedScores) else MaskedScores(held)
        if keys is None or base.keys not in (None, keys):
            return None
        if c.batch_axis(base.scores) not in (0, None):
            return None
        return dataclasses.replace(base, keys=keys)
    return None


def _along_keys(mask: KeyMask, scores: tuple[int, ...]) -> bool:
    """mask [N, 1, ..., 1, T] of the ids [N, T] runs along the keys of scores [N, ..., T]."""
    shape = mask.shape
    return (
        len(mask.ids) == 2
        and len(shape) == len(scores)
        and shape[0] == scores[0] == mask.ids[0]
        and shape[-1] == scores[-1] == mask.ids[1]
        and all(d == 1 for d in shape[1:-1])
    )


def _causal_added(c: Any, n: torch.fx.Node) -> MaskedScores | None:
    """`scores + mask` with `mask` a constant holding -inf or at most HIDING above the diagonal
    and 0 elsewhere (`nn.Transformer.generate_square_subsequent_mask(T)`, a triu buffer of
    -1e4): the scores with each query's later keys hidden (other constants with hidden
    entries are refused by node, is_causal_mask); None where n is not that."""
    for m, x in (n.args, reversed(n.args)):
        values = static_tensor(c, m)
        if values is None or values.dtype.kind != "f" or not (values <= HIDING).any():
            continue
        held = c.env.get(x) if isinstance(x, torch.fx.Node) else None
        if not isinstance(held, (Value, MaskedScores)) or c.shape(x) != c.shape(n):
            return None
        if not is_causal_mask(c, n, m, tuple(c.shape(n)), hides=True):
            return None
        base = held if isinstance(held, MaskedScores) else MaskedScores(held)
        if c.batch_axis(base.scores) not in (0, None):
            return None
        return dataclasses.replace(base, causal=True)
    return None


def fill_tables(c: Any, vocab: int) -> None:
    """Give each mask table of `as_activation` its `vocab` rows: for id j, its `on` value where
    j cmp value holds, else its `off`."""
    ids = np.arange(vocab)
    for at, node in enumerate(c.b.nodes):
        if node.op is Op.PARAM and node.out in c.id_masks:
            cmp, value, on, off = c.id_masks[node.out]
            table = np.where(key_hidden(ids, cmp, value), on, off).astype(np.float32)[:, None]
            c.params[str(node.attrs.name)] = table
            c.b.nodes[at] = dataclasses.replace(node, types=(node.type.with_shape(table.shape),))


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
