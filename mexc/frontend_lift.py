"""Functions of parameters, lifted over the batch.

A model may apply a function to a parameter before an activation reads it: EfficientViM's
`x + sigmoid(self.alpha).view(4, -1, 1, 1)[0] * (conv(x) - x)`, a learned gate
`x * torch.sigmoid(self.gate)`, a positive scale `x * F.softplus(self.s)`. mexc's ops take a
parameter only as a layer's weight, a scale, an embedding or a class token; a function of one
has no op of its own. Such a function is computed once per sample instead: the parameter is
repeated over the batch (`lifted_over_batch`, the class token's EXPAND_PARAM, whose gradient
sums the samples'), and every step from it to the activation that reads it runs on the
repeated tensor, as on any activation (the sigmoid's table product, a reshape, a slice, the
squeeze-and-excitation product). The values are those of the float model; the cost is one
copy of the parameter per sample, for parameters that are a vector or a few.

This module rewrites the traced graph before conversion: each such region of nodes is copied
with a leading batch axis (view shapes, indices and dims moved by one), and the reader reads the
copy. A region with a node of another kind than `_kind` names (a reduction, a buffer, a tensor
index) is left as it was, and the frontend refuses it as before, by name.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

from mexc.ops.common import STATIC_VALUE, is_float_tensor
from mexc.ops.tensor import lifted_over_batch

# functions and methods that act on each element alone (scalars as their other arguments)
_ELEMENTWISE_FUNCTIONS = {
    torch.sigmoid,
    torch.tanh,
    torch.relu,
    torch.clamp,
    torch.neg,
    F.sigmoid,
    F.tanh,
    F.relu,
    F.softplus,
    F.silu,
    F.gelu,
    F.hardtanh,
    F.hardsigmoid,
    F.elu,
    F.leaky_relu,
}
_ELEMENTWISE_METHODS = {"sigmoid", "tanh", "relu", "clamp", "clip", "neg"}
_ARITHMETIC = {
    operator.mul,
    operator.add,
    operator.sub,
    operator.truediv,
    operator.neg,
    torch.mul,
    torch.add,
    torch.sub,
    torch.div,
}
_ARITHMETIC_METHODS = {"mul", "add", "sub", "div", "__mul__", "__add__", "__sub__", "__truediv__"}
# in-place arithmetic on the activation (`x.mul_(sigmoid(p))`, `x *= ...`): readers only (a
# parameter changed in place is not a function of it)
_IN_PLACE = {operator.imul, operator.iadd, operator.isub, operator.itruediv}
_IN_PLACE_METHODS = {"mul_", "add_", "sub_", "div_"}
_RESHAPES = {"view", "reshape"}
# two-tensor maxima and minima, which mexc takes of activations of one shape
_MINMAX = {torch.maximum, torch.minimum, torch.max, torch.min}
_MINMAX_METHODS = {"maximum", "minimum", "max", "min"}
_DIM_KEYWORDS = ("dim", "dim0", "dim1", "dims", "start_dim", "end_dim")


def _tensor(n: Any) -> bool:
    return isinstance(n, torch.fx.Node) and is_float_tensor(n)


def _shape(n: torch.fx.Node) -> tuple[int, ...]:
    return tuple(int(d) for d in n.meta["tensor_meta"].shape)


def _moved_dim(d: Any, rank: int) -> Any:
    """Dim d (an int, or a tuple or list of them) of a rank-`rank` tensor, on its copy with a
    leading batch axis."""
    if isinstance(d, (tuple, list)):
        return type(d)(_moved_dim(i, rank) for i in d)
    return d % rank + 1


def depends_on_input(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, bool]:
    """Whether each node's values depend on the model's input (sizes read from it do not
    count: `p.expand(x.shape[0], ...)` is a function of p)."""
    out: dict[torch.fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out[n] = True
        elif n.op == "get_attr":
            out[n] = False
        else:
            reads = [a for a in n.all_input_nodes if STATIC_VALUE not in a.meta]
            out[n] = any(out.get(a, False) for a in reads)
    return out


def _kind(n: torch.fx.Node, parameters: frozenset[str]) -> str:
    """How a node of a parameter's region is lifted: "leaf" (a parameter), "elementwise",
    "arithmetic", "softmax", "reshape", "index", "dims" (unsqueeze / squeeze / permute /
    transpose / flatten), or "" (not liftable: the region is left alone)."""
    if n.op == "get_attr":
        return "leaf" if str(n.target) in parameters else ""
    if n.op == "call_function":
        if n.target in _ELEMENTWISE_FUNCTIONS:
            return "elementwise"
        if n.target in _ARITHMETIC:
            return "arithmetic"
        if n.target is operator.getitem:
            return "index"
        if n.target in (torch.reshape,):
            return "reshape"
        if n.target in (torch.flatten, torch.unsqueeze, torch.squeeze, torch.transpose):
            return "dims"
        if n.target in (torch.softmax, F.softmax):
            return "softmax"
        return ""
    if n.op == "call_method":
        name = str(n.target)
        if name in _ELEMENTWISE_METHODS:
            return "elementwise"
        if name in _ARITHMETIC_METHODS:
            return "arithmetic"
        if name in _RESHAPES:
            return "reshape"
        if name == "softmax":
            return "softmax"
        if name in ("unsqueeze", "squeeze", "permute", "transpose", "flatten"):
            return "dims"
    return ""


class _Lifter:
    """Copies of a parameter region's nodes with a leading batch axis of `batch`."""

    def __init__(self, gm: torch.fx.GraphModule, batch: int, parameters: frozenset[str]):
        self.gm, self.batch, self.parameters = gm, batch, parameters
        self.copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def liftable(self, n: torch.fx.Node, function: bool) -> bool:
        """Every node of n's region can be lifted (and, where `function`, at least one is a
        function: parameters and reshapes alone that arithmetic reads are a scale or an
        embedding, which mexc reads as such)."""
        seen: set[torch.fx.Node] = set()
        kinds: set[str] = set()
        todo = [n]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            kind = _kind(m, self.parameters)
            if not kind or not (m.op == "get_attr" or _tensor(m)):
                return False
            if kind == "index" and not self._plain_index(m.args[1]):
                return False
            if kind in ("dims", "softmax") and not self._movable_dims(m):
                return False
            if kind == "elementwise" and len(m.all_input_nodes) > 1:
                return False  # a bound that is a tensor (torch.clamp(p, min=q))
            kinds.add(kind)
            todo += [a for a in m.all_input_nodes if a.op != "placeholder"]
            if kind == "arithmetic" and len({len(_shape(a)) for a in m.all_input_nodes}) > 1:
                return False  # two regions of different ranks broadcast differently lifted
        return not function or bool(kinds & {"elementwise", "arithmetic", "softmax"})

    @staticmethod
    def _plain_index(index: Any) -> bool:
        items = index if isinstance(index, tuple) else (index,)
        return all(isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in items)

    @staticmethod
    def _movable_dims(n: torch.fx.Node) -> bool:
        name = str(getattr(n.target, "__name__", n.target))
        if name in ("squeeze", "softmax") and len(n.args) < 2 and "dim" not in n.kwargs:
            return False  # squeeze() would drop a batch of 1, softmax() take it
        src = n.args[0]
        if name != "unsqueeze" and isinstance(src, torch.fx.Node) and not _shape(src):
            return False  # a 0-dim tensor's dims (flatten()) name no axis
        dims = [*n.args[1:], *(v for k, v in n.kwargs.items() if k in _DIM_KEYWORDS)]
        flat = [d for a in dims for d in (a if isinstance(a, (tuple, list)) else (a,))]
        return all(isinstance(d, int) for d in flat)

    def lift(self, n: torch.fx.Node) -> torch.fx.Node:
        """The copy of region node n over the batch, made right after n: every reader of n
        comes later, whichever of them asks first."""
        if n in self.copies:
            return self.copies[n]
        g = self.gm.graph
        args = list(torch.fx.node.map_arg(n.args, self.lift))
        kwargs = dict(torch.fx.node.map_arg(n.kwargs, self.lift))
        kind = _kind(n, self.parameters)
        with g.inserting_after(n):
            if kind == "leaf":
                copy = g.call_function(lifted_over_batch, (n, self.batch))
            else:
                args, kwargs = self._moved(n, kind, args, kwargs)
                copy = g.create_node(n.op, n.target, tuple(args), kwargs)
        copy.meta = {k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")}
        self.copies[n] = copy
        return copy

    def _moved(
        self, n: torch.fx.Node, kind: str, args: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """n's arguments for its copy over a leading batch axis."""
        rank = len(_shape(n.args[0])) if isinstance(n.args[0], torch.fx.Node) else 0
        if kind == "reshape":
            if len(args) > 1:
                sizes = list(args[1]) if isinstance(args[1], (tuple, list)) else args[1:]
            else:
                given = kwargs.pop("shape", kwargs.pop("size", ()))
                sizes = list(given) if isinstance(given, (tuple, list)) else [given]
            return [args[0], (self.batch, *sizes)], kwargs  # torch.reshape takes one tuple
        if kind == "index":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return [args[0], (slice(None), *index)], kwargs
        if kind in ("dims", "softmax"):
            name = str(getattr(n.target, "__name__", n.target))
            out_rank = len(_shape(n))
            dims = list(args[1:])
            if name == "flatten":  # its defaults name the batch's axis too
                start = dims[0] if dims else kwargs.get("start_dim", 0)
                end = dims[1] if len(dims) > 1 else kwargs.get("end_dim", -1)
                return [args[0], _moved_dim(start, rank), _moved_dim(end, rank)], {}
            if name == "permute":
                dims = list(dims[0]) if dims and isinstance(dims[0], (tuple, list)) else dims
                if "dims" in kwargs:
                    dims = list(kwargs.pop("dims"))
                return [args[0], 0, *_moved_dim(dims, rank)], kwargs
            # unsqueeze counts dims in the result's rank, the others in the operand's
            r = out_rank if name == "unsqueeze" else rank
            moved = [_moved_dim(d, r) for d in dims]
            moved_kw = {k: _moved_dim(v, r) if k in _DIM_KEYWORDS else v for k, v in kwargs.items()}
            return [args[0], *moved], moved_kw
        return args, kwargs


def _reads(user: torch.fx.Node, x: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """The other operand of `user` on region value x, where it is a tensor, and how `user`
    reads the two: "arithmetic" (binary, broadcasting) or "minmax" (torch.maximum and the
    like, which mexc takes of one shape): the ops that lifting serves."""
    in_place = user.target in _IN_PLACE or (
        user.op == "call_method" and user.target in _IN_PLACE_METHODS
    )
    if in_place and user.args[0] is x:
        return None  # the function itself changed in place
    if _kind(user, frozenset()) == "arithmetic" or in_place:
        how = "arithmetic"
    elif user.target in _MINMAX or (user.op == "call_method" and user.target in _MINMAX_METHODS):
        how = "minmax"
    else:
        return None
    others = [a for a in user.args[:2] if isinstance(a, torch.fx.Node) and a is not x]
    return (others[0], how) if len(others) == 1 and _tensor(others[0]) else None


def lift_parameter_functions(gm: torch.fx.GraphModule, batch: int) -> bool:
    """Rewrite every function of parameters that binary arithmetic with an activation reads
    (module docstring); True where the graph changed (its shapes must be propagated again)."""
    parameters = frozenset(name for name, _ in gm.named_parameters())
    batched = depends_on_input(gm)
    lifter = _Lifter(gm, batch, parameters)
    changed = False
    for n in list(gm.graph.nodes):
        if batched.get(n, True) or not _tensor(n):
            continue
        for user in list(n.users):
            read = _reads(user, n)
            if read is None or not batched.get(read[0], False):
                continue
            other, how = read
            if n.op == "get_attr" and how == "arithmetic":
                continue  # a scale or an embedding, which mexc reads as such
            if not lifter.liftable(n, function=how == "arithmetic"):
                continue
            wide, rank = _shape(other), len(_shape(n))
            if rank > len(wide) or not wide or wide[0] != batch:
                continue  # the activation's leading axis is not the batch
            if how == "minmax" and _shape(user) != wide:
                continue  # the function, not the activation, is the wider: mexc's rule refuses
            padded = (1,) * (len(wide) - rank) + _shape(n)
            if padded[0] != 1:
                continue  # the function's values vary along the batch axis
            lifted = lifter.lift(n)
            with gm.graph.inserting_before(user):
                aligned = gm.graph.call_method("reshape", (lifted, batch, *padded[1:]))
                made = [aligned]
                if how == "minmax":  # of the activation's shape
                    aligned = gm.graph.call_method("expand", (aligned, *wide))
                    made.append(aligned)
            for m in made:
                m.meta = {k: v for k, v in n.meta.items() if k == "stack_trace"}
            user.replace_input_with(n, aligned)
            changed = True
    if changed:
        # the originals nothing reads any more (not fx's eliminate_dead_code, which takes an
        # in-place method, `x.mul_(s)`, whose result nobody reads, for dead)
        for n in reversed(list(gm.graph.nodes)):
            if n in lifter.copies and not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
    return changed
