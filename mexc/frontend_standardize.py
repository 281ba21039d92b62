"""Weight standardization's gain times a number, converted with the norm.

timm's ScaledStdConv2d (NFNets) standardizes its weight with
`F.batch_norm(w.reshape(1, O, -1), None, None, weight=(self.gain * self.scale).view(-1), ...)`:
a gain parameter times a number. The frontend converts traced nodes in order, so the product
would be converted on its own, before the norm that reads it, as a parameter used as an
activation. This rewrite hands the norm `gain_times(gain.view(-1), number)` instead
(mexc.ops.norm), which the norm's converter takes as its affine: the weight is rounded once,
at its own exponent, as timm computes it (the number applied to the norm's result instead
would round it twice, the first time at the coarser step of the unscaled values).
Runs on the traced graph before conversion (mexc.frontend.trace).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from mexc.ops.common import called_name, finite_number, static_value
from mexc.ops.norm import gain_times

_VIEWS = ("view", "reshape", "flatten")


def _scaled_parameter(w: Any) -> tuple[torch.fx.Node, float] | None:
    """(the gain's get_attr node, the number) where w is `gain * number`, `number * gain`,
    `gain.mul(number)` or `gain / number` seen through views; the number finite and nonzero (a
    gain times 0 is left to the frontend's refusal of a scale by 0)."""
    node = w
    while isinstance(node, torch.fx.Node) and called_name(node) in _VIEWS:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or len(node.args) != 2 or node.kwargs:
        return None
    name = called_name(node)
    if name not in ("mul", "truediv", "div"):
        return None
    a, b = (static_value(v) for v in node.args)
    pairs = ((a, b),) if name != "mul" else ((a, b), (b, a))
    for gain, number in pairs:
        if isinstance(gain, torch.fx.Node) and gain.op == "get_attr" and finite_number(number):
            factor = float(number) if name == "mul" else 1.0 / float(number) if number else 0.0
            return (gain, factor) if factor and math.isfinite(factor) else None
    return None


def _standardizes_a_parameter(n: torch.fx.Node) -> bool:
    """n is F.batch_norm of a parameter seen through views (weight standardization)."""
    x = n.args[0] if n.args else n.kwargs.get("input")
    while isinstance(x, torch.fx.Node) and called_name(x) in _VIEWS:
        x = x.args[0]
    return isinstance(x, torch.fx.Node) and x.op == "get_attr"


def gains_in_place(gm: torch.fx.GraphModule) -> bool:
    """Rewrite every standardization whose weight is a parameter times a number to read
    `gain_times(parameter, number)`; whether any was rewritten."""
    changed = False
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not F.batch_norm:
            continue
        if not _standardizes_a_parameter(n):
            continue
        in_args = len(n.args) > 3
        w = n.args[3] if in_args else n.kwargs.get("weight")
        found = _scaled_parameter(w)
        if found is None:
            continue
        gain, number = found
        with graph.inserting_before(n):
            flat = graph.call_method("view", (gain, -1))
            scaled = graph.call_function(gain_times, (flat, number))
        if in_args:
            n.args = (*n.args[:3], scaled, *n.args[4:])
        else:
            n.kwargs = {**n.kwargs, "weight": scaled}
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
