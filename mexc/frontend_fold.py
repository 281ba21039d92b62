"""Folding, on the host, of what a model computes from its parameters and buffers alone
before an activation meets them (mexc.ops.gather): an element-moving op on a parameter (index,
view, permute, roll, ...) applied to the parameter's map of flat indices, and any op on integer
buffers (relative-position offsets) applied to their values. torch computes both, so the map
is torch's own indexing."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
import torch.fx

from mexc.errors import UnsupportedOpError
from mexc.ops.common import ParamView, called_name, is_traced_tensor, static_value
from mexc.ops.gather import Concatenated, Const, Gathered, as_gathered, held_values

# ops that only move elements: applied to the index map they give the moved map
_MOVES = {
    "view",
    "reshape",
    "permute",
    "transpose",
    "swapaxes",
    "swapdims",
    "unsqueeze",
    "squeeze",
    "flatten",
    "contiguous",
    "expand",
    "repeat",
    "flip",
    "roll",
    "t",
    "index_select",
    "__getitem__",
}
_MOVE_FUNCTIONS: dict[Any, str] = {
    operator.getitem: "__getitem__",
    torch.reshape: "reshape",
    torch.permute: "permute",
    torch.transpose: "transpose",
    torch.swapaxes: "swapaxes",
    torch.swapdims: "swapdims",
    torch.unsqueeze: "unsqueeze",
    torch.squeeze: "squeeze",
    torch.flatten: "flatten",
    torch.roll: "roll",
    torch.flip: "flip",
    torch.index_select: "index_select",
    torch.t: "t",
}
# the attributes that move elements: w.T reverses the axes, w.mT swaps the last two (a tied
# embedding read as the head, h @ self.emb.weight.T)
_MOVE_ATTRIBUTES = {"T": "t", "mT": "transpose"}
# what makes a node worth folding although its data input is a plain parameter: ops the other
# converters take on parameters (reshape: ParamView; expand: a class token) are left to them
_STARTS = {
    "__getitem__",
    "permute",
    "transpose",
    "swapaxes",
    "swapdims",
    "flip",
    "roll",
    "t",
    "index_select",
    "repeat",
}


def _move_name(n: torch.fx.Node) -> str | None:
    if n.op == "call_method":
        return str(n.target) if n.target in _MOVES else None
    if n.op == "call_function" and n.target is getattr:
        return _MOVE_ATTRIBUTES.get(str(n.args[1]))
    if n.op == "call_function":
        return _MOVE_FUNCTIONS.get(n.target)
    return None


# tensors made from shapes alone: the activation a method is called on gives only its dtype
_MAKERS = {
    "new_zeros",
    "new_ones",
    "new_full",
    "new_tensor",
    "zeros_like",
    "ones_like",
    "full_like",
}
_META = ("device", "dtype")  # attributes of a traced tensor a constant's maker may read
# random draws are not constants
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential")


def _operand(c: Any, a: torch.fx.Node) -> Gathered | Const | None:
    held = c.env.get(a)
    if isinstance(held, Const):
        return held
    if a.op == "get_attr":
        t = c.fetch(a)
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            return Const(t.detach().cpu().clone())  # folding may write to it (setitem)
    return as_gathered(c, a)


def _stand_in(a: torch.fx.Node) -> torch.Tensor:
    """A zero tensor of a traced activation's shape and dtype (new_zeros and zeros_like read
    only those)."""
    meta = a.meta["tensor_meta"]
    return torch.zeros(tuple(meta.shape), dtype=meta.dtype)


_CATS = (torch.cat, torch.concat, torch.concatenate)


def _concatenated(c: Any, n: torch.fx.Node, operands: dict[torch.fx.Node, Any]) -> Any:
    """torch.cat of parameters and constants (no activation) as a Concatenated; None where
    the parts are not all tensors of one rank."""
    args = dict(zip(("tensors", "dim"), n.args)) | dict(n.kwargs)
    items = args["tensors"]
    if not isinstance(items, (list, tuple)) or not all(a in operands for a in items):
        return None
    parts = [as_gathered(c, a) for a in items]
    if any(p is None for p in parts) or len({p.index.ndim for p in parts if p}) != 1:
        return None
    rank = parts[0].index.ndim  # type: ignore[union-attr]
    dim = static_value(args.get("dim", 0))
    return Concatenated(tuple(p for p in parts if p), int(dim) % rank - rank)


def fold(c: Any, n: torch.fx.Node) -> Gathered | Const | Concatenated | None:
    """n's value as a Gathered parameter or a Const, or None where n is not one (its converter
    then handles it): any op on constants (integer buffers, tensors made from shapes: torch.zeros,
    x.new_zeros, arange, and what the model computes from them, writes into them included)
    evaluated on the host, or an element-moving op on a parameter, a float buffer or a folded
    value."""
    if n.op not in ("call_function", "call_method"):
        return None
    name = called_name(n)
    setitem = n.target is operator.setitem
    if not (setitem or is_traced_tensor(n)):
        return None
    if any(r in name.lower() for r in _RANDOM):
        return None
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), nodes.append)
    operands: dict[torch.fx.Node, Any] = {}
    for i, a in enumerate(nodes):
        if a in c.static:
            continue
        # a maker reads only its first operand's shape and dtype (of a parameter too: DETR's
        # torch.zeros_like(query_pos))
        got = Const(_stand_in(a)) if i == 0 and name in _MAKERS else _operand(c, a)
        if got is None:
            return None  # reads an activation
        operands[a] = got
    data = [a for a, v in operands.items() if isinstance(v, Gathered)]
    if data and n.target in _CATS:
        return _concatenated(c, n, operands)
    move = _move_name(n)
    arithmetic = bool(data) and (move is None or len(data) > 1)
    held = [held_values(operands[a]) for a in data] if arithmetic else []
    if arithmetic and all(h is not None for h in held):
        # arithmetic on constants held as Gathered (float buffers, float tensors the forward
        # made: DINOv3's RoPE periods) is a constant too: evaluated on their values
        for a, h in zip(data, held):
            operands[a] = Const(torch.from_numpy(h))
        data = []
    if data:
        first = n.args[0] if n.args else None
        if len(data) > 1 or move is None or data[0] is not first:
            return None  # arithmetic on a parameter, or two of them: not an index map
        folded = isinstance(c.env.get(first), (Gathered, ParamView))
        if not folded and move not in _STARTS:
            return None
    elif not operands and n.op == "call_method":
        return None

    def concrete(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = operands.get(a)
            if isinstance(v, Gathered):
                return torch.from_numpy(v.index)
            if isinstance(v, Const):
                return v.value
            src = a.args[0] if a.args else None
            if a.target is getattr and isinstance(src, torch.fx.Node) and a.args[1] in _META:
                return getattr(_stand_in(src), str(a.args[1]))  # x.device: the host's
            return static_value(a)
        return a

    args = torch.fx.node.map_aggregate(n.args, concrete)
    kwargs = torch.fx.node.map_aggregate(n.kwargs, concrete)
    try:
        if n.op == "call_method":
            out = getattr(args[0], str(n.target))(*args[1:], **kwargs)
        else:
            out = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception as err:  # noqa: BLE001 - the model's own error, in one line
        raise UnsupportedOpError(
            c.describe(n, f"computes a constant or indexes a parameter and fails: {err}")
        ) from None
    if setitem:
        target = n.args[0]
        return operands.get(target) if isinstance(target, torch.fx.Node) else None  # in place
    if not isinstance(out, torch.Tensor):
        return None
    if data:
        src = operands[data[0]]
        assert isinstance(src, Gathered)
        return Gathered(src.source, out.numpy().astype(np.int64))
    return Const(out)
