"""Complex tensors as pairs of reals.

Meta's LLaMA, and the code written after it (Mistral's reference, many LLaMA ports), applies
rotary embeddings as a complex product: the last axis of a query is seen as D/2 complex numbers
(`torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))`), multiplied by a constant table of
unit complex numbers (`freqs_cis`), and seen as real again (`torch.view_as_real(...)
.flatten(3)`). mexc's values are real. This module rewrites the traced graph before conversion
so that each complex activation is the real tensor it is a view of, every number an (re, im)
pair along a last axis of 2:

- `view_as_complex(t)` is t; `view_as_real(z)` is z's pair tensor;
- z * w for a constant w (input-independent: a buffer, a tensor attribute, a table computed in
  forward): (a + ib)(c + id) = (ac - bd) + i(ad + bc), that is t * [c, c] + swap(t) * [-d, d],
  where swap exchanges each pair (torch.roll by one along the pair axis). Two products by
  constant factors and a sum: the rotate-half form of real rotary embeddings. A real w (a
  number) is one product;
- z + w and z - w, of two complex activations or of one and a constant: the pairs' sum or
  difference;
- z.view(shape) and z.reshape(shape): the pair tensor seen as shape + [2].

The constants are evaluated here, once, on the host (float64, then float32 factors). Any other
use of a complex activation is refused by node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from mexc.errors import UnsupportedOpError
from mexc.frontend_lift import depends_on_input
from mexc.ops.common import STATIC_VALUE

_MUL_FUNCTIONS = (operator.mul, torch.mul)
_ADD_FUNCTIONS: dict[Any, float] = {
    operator.add: 1.0,
    torch.add: 1.0,
    operator.sub: -1.0,
    torch.sub: -1.0,
}
_ADD_METHODS = {"add": 1.0, "sub": -1.0}
_RESHAPES = ("view", "reshape")
# the name every rewritten product's constant factors are registered under, on the traced module
FACTOR_PREFIX = "_mexc_complex"

Describe = Callable[[torch.fx.Node, str], str]


def is_complex(n: Any) -> bool:
    """n is a traced node whose value is a complex tensor."""
    meta = n.meta.get("tensor_meta") if isinstance(n, torch.fx.Node) else None
    return meta is not None and getattr(meta, "dtype", torch.float32).is_complex


def complex_as_pairs(gm: torch.fx.GraphModule, describe: Describe) -> bool:
    """Rewrite every complex activation of `gm` as its pair tensor (module docstring). True
    where the graph changed (its shapes must then be propagated again)."""
    graph = gm.graph
    if not any(is_complex(n) for n in graph.nodes):
        return False
    batched = depends_on_input(gm)
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}
    readers: set[torch.fx.Node] = set()  # the view_as_real nodes, read no more
    for n in list(graph.nodes):
        if is_complex(n) and batched.get(n, False):
            with graph.inserting_before(n):
                pairs[n] = _pair(gm, n, pairs, batched, describe)
            _copy_source(n, pairs[n])
    for n in list(graph.nodes):
        if n in pairs or not any(a in pairs for a in n.all_input_nodes):
            continue
        if n.op == "call_function" and n.target is torch.view_as_real:
            n.replace_all_uses_with(pairs[n.args[0] if n.args else n.kwargs["input"]])
            readers.add(n)
        else:
            raise UnsupportedOpError(describe(n, _REFUSAL.format(what="reads a complex tensor")))
    _erase_unused(graph, set(pairs) | readers | _complex_constants(graph))
    gm.recompile()
    return True


_REFUSAL = (
    "{what}; mexc computes complex tensors as pairs of reals for rotary embeddings: "
    "torch.view_as_complex, products with a constant (freqs_cis), sums and differences, view "
    "and reshape, and torch.view_as_real. Write the other complex arithmetic with real tensors"
)


def _pair(
    gm: torch.fx.GraphModule,
    n: torch.fx.Node,
    pairs: dict[torch.fx.Node, torch.fx.Node],
    batched: dict[torch.fx.Node, bool],
    describe: Describe,
) -> torch.fx.Node:
    """The pair tensor of complex activation n, its nodes inserted at the graph's insert
    point."""
    graph = gm.graph
    real = [
        a
        for a in n.all_input_nodes
        if batched.get(a, False) and a not in pairs and STATIC_VALUE not in a.meta
    ]
    if n.op in ("call_function", "call_method") and real and n.target is not torch.view_as_complex:
        what = f"combines a complex tensor with the real activation '{real[0].name}'"
        raise UnsupportedOpError(describe(n, _REFUSAL.format(what=what)))
    if n.op == "call_function" and n.target is torch.view_as_complex:
        source = n.args[0] if n.args else n.kwargs.get("input")
        assert isinstance(source, torch.fx.Node)  # a complex activation comes from a tensor
        return source
    args: list[Any] = [*n.args, *(v for k, v in n.kwargs.items() if k in ("input", "other"))]
    if n.kwargs.get("alpha", 1) != 1:
        raise UnsupportedOpError(describe(n, _REFUSAL.format(what="uses alpha != 1")))
    if (n.op == "call_function" and n.target in _MUL_FUNCTIONS) or (
        n.op == "call_method" and n.target == "mul"
    ):
        z, w = (args[0], args[1]) if args[0] in pairs else (args[1], args[0])
        if w in pairs:
            raise UnsupportedOpError(
                describe(n, _REFUSAL.format(what="multiplies two complex activations"))
            )
        return _times_constant(gm, n, pairs[z], _constant(gm, n, w, describe))
    sign = (
        _ADD_FUNCTIONS.get(n.target)
        if n.op == "call_function"
        else _ADD_METHODS.get(str(n.target))
        if n.op == "call_method"
        else None
    )
    if sign is not None:
        a, b = (
            pairs.get(x) or _factor(gm, n, "plus", _as_pairs(_constant(gm, n, x, describe)))
            for x in args
        )
        return graph.call_function(operator.add if sign > 0 else operator.sub, (a, b))
    if n.op == "call_method" and n.target in _RESHAPES:
        shape = args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = list(shape[0])
        return graph.call_method("reshape", (pairs[args[0]], *shape, 2))
    raise UnsupportedOpError(describe(n, _REFUSAL.format(what="computes a complex tensor")))


def _times_constant(
    gm: torch.fx.GraphModule, n: torch.fx.Node, t: torch.fx.Node, w: torch.Tensor
) -> torch.fx.Node:
    """t * [c, c] + swap(t) * [-d, d] for w = c + id (module docstring); t * [c, c] where w is
    real."""
    w = w.to(torch.complex128)
    real = _factor(gm, n, "re", torch.stack([w.real, w.real], -1))
    product = gm.graph.call_function(operator.mul, (t, real))
    if not bool((w.imag != 0).any()):
        return product
    imag = _factor(gm, n, "im", torch.stack([-w.imag, w.imag], -1))
    swapped = gm.graph.call_function(torch.roll, (t, 1, -1))
    return gm.graph.call_function(
        operator.add, (product, gm.graph.call_function(operator.mul, (swapped, imag)))
    )


def _as_pairs(w: torch.Tensor) -> torch.Tensor:
    """Constant w as pairs (re, im) along a last axis of 2."""
    w = w.to(torch.complex128)
    return torch.stack([w.real, w.imag], -1)


def _factor(gm: torch.fx.GraphModule, n: torch.fx.Node, part: str, value: torch.Tensor) -> Any:
    """A get_attr node of `value` (float32), registered on gm as a buffer named after n."""
    name = f"{FACTOR_PREFIX}_{n.name}_{part}"
    gm.register_buffer(name, value.to(torch.float32).contiguous(), persistent=False)
    return gm.graph.get_attr(name)


def _constant(
    gm: torch.fx.GraphModule, n: torch.fx.Node, w: Any, describe: Describe
) -> torch.Tensor:
    """The value of w, a number or a node that does not depend on the model's input; refused
    where it is computed from a trained parameter (learned rotary frequencies), which the
    evaluation would hold fixed."""
    if not isinstance(w, torch.fx.Node):
        return torch.as_tensor(w)
    trained = _trained_source(gm, w)
    if trained is not None:
        what = f"multiplies a complex tensor by a function of the parameter '{trained}'"
        raise UnsupportedOpError(
            describe(n, _REFUSAL.format(what=what) + ", or keep the factor a buffer")
        )
    return torch.as_tensor(_evaluate(gm, w, {}))


def _trained_source(gm: torch.fx.GraphModule, w: torch.fx.Node) -> str | None:
    """The name of a parameter that requires a gradient among w's sources, if any (not through
    numbers computed from shapes, x.shape[1])."""
    todo, seen = [w], set()
    while todo:
        m = todo.pop()
        if m in seen or STATIC_VALUE in m.meta:
            continue
        seen.add(m)
        if m.op == "get_attr":
            held = _attribute(gm, m)
            if isinstance(held, torch.nn.Parameter) and held.requires_grad:
                return str(m.target)
        todo.extend(m.all_input_nodes)
    return None


def _evaluate(gm: torch.fx.GraphModule, n: Any, memo: dict[torch.fx.Node, Any]) -> Any:
    """The value of an input-independent node: its shape-derived number, or its function of
    the module's tensors, computed with torch on the host."""
    if not isinstance(n, torch.fx.Node):
        return n
    if n in memo:
        return memo[n]
    if STATIC_VALUE in n.meta:
        value = n.meta[STATIC_VALUE]
    elif n.op == "get_attr":
        value = _attribute(gm, n).detach()
    else:
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: _evaluate(gm, a, memo))
        with torch.no_grad():
            if n.op == "call_function":
                value = n.target(*args, **kwargs)  # type: ignore[operator]
            elif n.op == "call_method":
                value = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:
                value = gm.get_submodule(str(n.target))(*args, **kwargs)
    memo[n] = value
    return value


def _attribute(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Any:
    """What get_attr node n reads from gm (a parameter, a buffer, a traced tensor)."""
    held: Any = gm
    for part in str(n.target).split("."):
        held = getattr(held, part)
    return held


def _complex_constants(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The complex nodes left: constants (tables and their views) the rewrite evaluated."""
    return {n for n in graph.nodes if is_complex(n)}


def _erase_unused(graph: torch.fx.Graph, nodes: set[torch.fx.Node]) -> None:
    """Erase the nodes of `nodes` that nothing reads any more, and after each the nodes it read
    that nothing else reads (a complex table's get_attr, slices and views), last first."""
    for n in reversed(list(graph.nodes)):
        if n in nodes and not n.users and n.op in ("get_attr", "call_method", "call_function"):
            inputs = n.all_input_nodes
            graph.erase_node(n)
            nodes.update(a for a in inputs if not a.users)


def _copy_source(n: torch.fx.Node, pair: torch.fx.Node) -> None:
    """The pair's nodes report n's source line (the user's)."""
    if "stack_trace" in n.meta:
        todo, seen = [pair], set()
        while todo:
            m = todo.pop()
            if m in seen or m.op in ("placeholder", "get_attr") or "tensor_meta" in m.meta:
                continue
            seen.add(m)
            m.meta.setdefault("stack_trace", n.meta["stack_trace"])
            todo.extend(m.all_input_nodes)
