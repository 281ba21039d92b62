"""Weight standardization's gain, moved after the normalization.

timm's ScaledStdConv2d (NFNets) standardizes its weight with
`F.batch_norm(w.reshape(1, O, -1), None, None, weight=(self.gain * self.scale).view(-1), ...)`:
a gain parameter times a number. mexc takes a parameter as a norm's affine weight, not a product
computed from one (the product would be converted on its own, before the norm that reads it).
Since the norm has no bias, scaling its weight by a number scales its result by the number, so
this rewrite hands the norm the gain alone and multiplies its result by the number (a SCALE).
Runs on the traced graph before conversion (mexc.frontend.trace); ops.norm converts the
standardization itself.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from mexc.ops.common import called_name, finite_number, static_value

_VIEWS = ("view", "reshape", "flatten")
_MULS = (operator.mul, torch.mul)


def _scaled_parameter(w: Any) -> tuple[torch.fx.Node, float] | None:
    """(the gain's get_attr node, the number) where w is `(gain * number)` seen through views."""
    node = w
    while isinstance(node, torch.fx.Node) and called_name(node) in _VIEWS:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if node.target not in _MULS or len(node.args) != 2 or node.kwargs:
        return None
    a, b = (static_value(v) for v in node.args)
    for gain, number in ((a, b), (b, a)):
        if isinstance(gain, torch.fx.Node) and gain.op == "get_attr" and finite_number(number):
            return gain, float(number)
    return None


def _standardizes_a_parameter(n: torch.fx.Node) -> bool:
    """n is F.batch_norm of a parameter seen through views (weight standardization)."""
    x = n.args[0] if n.args else n.kwargs.get("input")
    while isinstance(x, torch.fx.Node) and called_name(x) in _VIEWS:
        x = x.args[0]
    return isinstance(x, torch.fx.Node) and x.op == "get_attr"


def move_gains_after(gm: torch.fx.GraphModule) -> bool:
    """Rewrite every standardization whose weight is a parameter times a number to take the
    parameter and multiply its result by the number; whether any was rewritten."""
    changed = False
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not F.batch_norm:
            continue
        if not _standardizes_a_parameter(n):
            continue
        bias = n.args[4] if len(n.args) > 4 else n.kwargs.get("bias")
        in_args = len(n.args) > 3
        w = n.args[3] if in_args else n.kwargs.get("weight")
        found = _scaled_parameter(w) if bias is None else None
        if found is None:
            continue
        gain, number = found
        with graph.inserting_before(n):
            flat = graph.call_method("view", (gain, -1))
        if in_args:
            n.args = (*n.args[:3], flat, *n.args[4:])
        else:
            n.kwargs = {**n.kwargs, "weight": flat}
        with graph.inserting_after(n):
            scaled = graph.call_function(operator.mul, (n, number))
        n.replace_all_uses_with(scaled, delete_user_cb=lambda u, s=scaled: u is not s)
        for made in (flat, scaled):  # error messages name the model's line
            made.meta["stack_trace"] = n.meta.get("stack_trace")
        _erase_unread(graph, w)
        changed = True
    if changed:
        gm.recompile()
    return changed


def _erase_unread(graph: torch.fx.Graph, node: Any) -> None:
    """The gain's product and its views, which nothing reads any more (not fx's
    eliminate_dead_code, which also takes in-place methods whose results nothing reads)."""
    while isinstance(node, torch.fx.Node) and node.op != "get_attr" and not node.users:
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0] if len(inputs) == 1 else None
