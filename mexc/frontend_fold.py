"""Folding, on the host, of what a model computes from its parameters and buffers alone
before an activation meets them (mexc.ops.gather): an element-moving op on a parameter (index,
view, permute, roll, ...) applied to the parameter's map of flat indices, and any op on integer
buffers (relative-position offsets) applied to their values. torch computes both, so the map
is torch's own indexing."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx

from mexc.errors import UnsupportedOpError
from mexc.ops.common import ParamView, static_value
from mexc.ops.gather import Gathered, as_gathered


@dataclass(frozen=True, eq=False)
class IndexConst:
    """An integer tensor computed from module buffers only (relative-position offsets): a
    constant of the graph, used to index a parameter."""

    value: torch.Tensor


# ops that only move elements: applied to the index map they give the moved map
_MOVES = {
    "view",
    "reshape",
    "permute",
    "transpose",
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
    torch.unsqueeze: "unsqueeze",
    torch.squeeze: "squeeze",
    torch.flatten: "flatten",
    torch.roll: "roll",
    torch.flip: "flip",
    torch.index_select: "index_select",
    torch.t: "t",
}
# what makes a node worth folding although its data input is a plain parameter: ops the other
# converters take on parameters (reshape: ParamView; expand: a class token) are left to them
_STARTS = {"__getitem__", "permute", "transpose", "flip", "roll", "t", "index_select", "repeat"}


def _move_name(n: torch.fx.Node) -> str | None:
    if n.op == "call_method":
        return str(n.target) if n.target in _MOVES else None
    if n.op == "call_function":
        return _MOVE_FUNCTIONS.get(n.target)
    return None


def _operand(c: Any, a: torch.fx.Node) -> Gathered | IndexConst | None:
    held = c.env.get(a)
    if isinstance(held, IndexConst):
        return held
    if a.op == "get_attr":
        t = c.fetch(a)
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            return IndexConst(t.detach().cpu())
    return as_gathered(c, a)


def fold(c: Any, n: torch.fx.Node) -> Gathered | IndexConst | None:
    """n's value as a Gathered parameter or an IndexConst, or None where n is not one (its
    converter then handles it): an integer op on module buffers (any torch op: it runs on the
    host), or an element-moving op on a parameter, a float buffer or a folded value."""
    if n.op not in ("call_function", "call_method") or not hasattr(
        n.meta.get("tensor_meta"), "shape"
    ):
        return None
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), nodes.append)
    operands: dict[torch.fx.Node, Gathered | IndexConst] = {}
    for a in nodes:
        if a in c.static:
            continue
        got = _operand(c, a)
        if got is None:
            return None  # reads an activation
        operands[a] = got
    data = [a for a, v in operands.items() if isinstance(v, Gathered)]
    move = _move_name(n)
    if data:
        first = n.args[0] if n.args else None
        if len(data) > 1 or move is None or data[0] is not first:
            return None  # arithmetic on a parameter, or two of them: not an index map
        folded = isinstance(c.env.get(first), (Gathered, ParamView))
        if not folded and move not in _STARTS:
            return None
    elif not operands:
        return None

    def concrete(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = operands.get(a)
            if isinstance(v, Gathered):
                return torch.from_numpy(v.index)
            if isinstance(v, IndexConst):
                return v.value
            return static_value(a)
        return a

    args = torch.fx.node.map_aggregate(n.args, concrete)
    kwargs = torch.fx.node.map_aggregate(n.kwargs, concrete)
    try:
        if n.op == "call_method":
            out = getattr(args[0], str(n.target))(*args[1:], **kwargs)
        else:
            out = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception as err:  # noqa: BLE001 - the model's own indexing error, in one line
        raise UnsupportedOpError(
            c.describe(n, f"indexes a parameter or buffer and fails on the host: {err}")
        ) from None
    if not isinstance(out, torch.Tensor):
        return None
    if data:
        src = operands[data[0]]
        assert isinstance(src, Gathered)
        return Gathered(src.source, out.numpy().astype(np.int64))
    if out.is_floating_point():
        return None  # a float constant computed from buffers: not folded
    return IndexConst(out)
