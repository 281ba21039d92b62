"""torch.fx frontend: trace an nn.Module into a float mexc graph.

We use `torch.fx.symbolic_trace` rather than `torch.export` (docs/frontend.md, with the
measurements): it keeps modules (Conv2d, BatchNorm2d, MultiheadAttention, ...) as single
call_module nodes with their qualified names, which map one to one onto mexc ops and give
readable parameter names, and it records the user's source line for every node. Data-dependent
control flow makes it fail with a TraceError that we rewrap with the offending line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import inspect
import keyword
import operator
import re
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx
from torch import nn
from torch.fx.experimental.meta_tracer import (
    MetaDeviceAttribute,
    MetaProxy,
    MetaTracer,
    manual_meta_overrides,
)
from torch.fx.passes import shape_prop
from torch.fx.passes.shape_prop import ShapeProp

from mexc import frontend_fold, frontend_index, frontend_mask_bounds
from mexc.arrangement import ATTR as ARRANGED
from mexc.arrangement import Arrangement
from mexc.errors import InputError, MexcError, TraceError, UnsupportedOpError
from mexc.frontend_complex import complex_as_pairs
from mexc.frontend_eval_modes import (
    MODULES_CALLED,
    apply_eval_modes,
    eval_submodules,
    set_modes,
    training_branches,
)
from mexc.frontend_key_masks import as_activation as key_mask_activation
from mexc.frontend_key_masks import fill_tables, key_mask_of, masked_scores
from mexc.frontend_lift import lift_parameter_functions
from mexc.frontend_modules import traced_forward
from mexc.frontend_resample import resampling_as_products
from mexc.frontend_standardize import gains_in_place
from mexc.ir import (
    EVAL_NORM_WEIGHTS,
    LABEL_SHAPE,
    Graph,
    GraphBuilder,
    Op,
    Value,
    fed_by_input,
)
from mexc.kernels.loss import MAX_CLASSES
from mexc.ops import REGISTRY, attrs, gather
from mexc.ops.attention import MASKED_READ, KeyMask, MaskedScores
from mexc.ops.common import (
    STATIC_VALUE,
    ParamView,
    called_name,
    is_float_tensor,
    is_traced_tensor,
    static_int,
    static_value,
    traced_dtype,
)
from mexc.ops.norm_written_out import ROOT_USES, RootMeanSquare, follow
from mexc.ops.recurrent import LayerStates, stacked_states
from mexc.ops.tensor import repeated_param, reshaped, transposed
from mexc.types import Kind, TensorType, f32


@dataclass
class FrontendResult:
    graph: Graph
    params: dict[str, np.ndarray]  # float initial values of PARAM nodes
    buffers: dict[str, np.ndarray]  # float initial values of STATE nodes (BN running stats)
    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    # parameters the model does not have, made for an op whose integer form needs them (the
    # ones and zeros of a LayerNorm without affine weight or bias): never trained
    constants: frozenset[str] = frozenset()


@dataclass
class _Ctx:
    gm: torch.fx.GraphModule
    b: GraphBuilder
    # a Value, or what a getitem reads: _Pieces (chunk, split, unbind), a tuple of results
    env: dict[torch.fx.Node, Any] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    param_values: dict[str, Value] = field(default_factory=dict)
    param_layouts: dict[str, str] = field(default_factory=dict)  # param's, "" as declared
    static: set[torch.fx.Node] = field(default_factory=set)  # shape-only Python values
    constants: set[str] = field(default_factory=set)  # FrontendResult.constants
    loc: str = ""
    axes: dict[Value, int | None] = field(default_factory=dict)  # batch_axis's, so far
    followed: int = 0  # nodes of b that batch_axis has seen
    parameter_names: frozenset[str] | None = None  # is_parameter's, once asked
    types: dict[Value, TensorType] = field(default_factory=dict)  # of the nodes it has seen
    batch: int = 0  # the input's leading axis
    arranged: dict[str, Arrangement] = field(default_factory=dict)  # params held rearranged
    # in-place changes (frontend_index.rebind): node -> the first node naming its tensor, and
    # the nodes a change rebound -> the position (in `position`) of the latest change
    names: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    rebound: dict[torch.fx.Node, int] = field(default_factory=dict)
    position: dict[torch.fx.Node, int] = field(default_factory=dict)  # each node's, in order
    # values converters share (ops.activation: a compared pair's difference and its masks)
    memo: dict[Any, Value] = field(default_factory=dict)
    norm_of: dict[Value, tuple[Value, tuple[int, ...]]] = field(default_factory=dict)  # norm.py
    tied: dict[int, str] = field(default_factory=dict)  # id of an nn.Parameter -> its name
    ids: Value | None = None  # the integer input (token ids), which only embeddings read
    # masks read as tensors -> the size their values reach (frontend_mask_bounds)
    mask_bounds: dict[torch.fx.Node, float] = field(default_factory=dict)
    # the constant tables that read masks of the ids as tensors -> (cmp, value, on, off)
    id_masks: dict[Value, tuple[str, int, float, float]] = field(default_factory=dict)
    node: torch.fx.Node | None = None  # the node being translated

    def is_token_ids(self, a: Any) -> bool:
        """`a` is the model's integer input (token ids)."""
        return self.ids is not None and isinstance(a, torch.fx.Node) and self.env.get(a) == self.ids

    def batch_axis(self, v: Value) -> int | None:
        """The axis of v that holds the batch (the ops' `moves_batch` rules, as the
        shard-batch pass follows them), None where v holds no batch axis or mexc lost it."""
        for node in self.b.nodes[self.followed :]:
            known = [(self.types[u], a) for u in node.inputs if (a := self.axes.get(u)) is not None]
            axis = REGISTRY[node.op].batch_axis(node, known)
            for i, t in enumerate(node.types):
                self.axes[node.result(i)] = axis
                self.types[node.result(i)] = t
        self.followed = len(self.b.nodes)
        return self.axes.get(v)

    def first_or_batch_axis(self, v: Value) -> int:
        """batch_axis, or 0 where mexc lost it (the batch-first convention)."""
        axis = self.batch_axis(v)
        return 0 if axis is None else axis

    def shape(self, n: Any) -> tuple[int, ...]:
        if not isinstance(n, torch.fx.Node):
            raise UnsupportedOpError(f"expected a tensor argument, got {n!r}")
        meta = n.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            raise UnsupportedOpError(_describe(n, "produces a non-tensor value mexc cannot use"))
        return tuple(int(d) for d in meta.shape)

    def param(
        self,
        name: str,
        tensor: torch.Tensor,
        role: str,
        layout: str = "",
        user: Any = None,
        arranged: Arrangement | None = None,
        tie: Any = None,
    ) -> Value:
        """The PARAM node of `name`, holding `tensor`: the parameter as declared (layout "")
        or rearranged for the op that reads it (`layout` names how: a weight an einsum
        contracts, held [out, in]; `arranged` how the model's tensor maps to the held one).
        mexc holds one copy of a parameter, so a second read in another layout is refused
        (naming the fx node `user`). `tie`: the model's nn.Parameter where `tensor` is a view
        of it (a Conv1d's weight.unsqueeze(2)), which layers sharing it share."""
        source = tie if tie is not None else tensor
        if isinstance(source, nn.Parameter):  # tied: one tensor under several module names
            name = self.tied.setdefault(id(source), name)
        if arranged is not None:
            self.arranged[name] = arranged
        held = self.param_layouts.setdefault(name, layout)
        if held != layout:
            what = (
                f"reads parameter '{name}' {layout or 'as declared'}, and another op reads it "
                f"{held or 'as declared'}; mexc holds one copy of each parameter, so use it "
                "in one layout (e.g. keep it as nn.Linear's weight and call the layer)"
            )
            raise UnsupportedOpError(_describe(user, what) if user is not None else what)
        if name not in self.param_values:
            arr = tensor.detach().cpu().numpy().astype(np.float32)
            node = self.b.add(Op.PARAM, (), f32(*arr.shape), attrs(Op.PARAM, name=name, role=role))
            self.params[name] = arr
            self.param_values[name] = node.out
        return self.param_values[name]

    def constant(self, name: str, value: np.ndarray, role: str) -> Value:
        """A parameter the model does not have, held at `value` and never trained, named
        "mexc.<name>" (no module path starts so; a suffix where another constant has it).
        One name, value and role is one constant: a buffer or traced table that two ops read
        (rotary cos for the queries and the keys) is held once. Constants of other names stay
        apart even where their values agree: some carry a meaning of their own (id_masks)."""
        held = np.array(value, np.float32)  # a copy: the program's, writable
        key = ("constant", name, role, held.shape, hashlib.sha256(held.tobytes()).hexdigest())
        if key in self.memo:
            return self.memo[key]
        name = f"mexc.{name}"
        unique, k = name, 1
        while unique in self.param_values:
            unique, k = f"{name}_{k}", k + 1
        self.constants.add(unique)
        self.memo[key] = self.param(unique, torch.from_numpy(held), role)
        return self.memo[key]

    def state(self, name: str, tensor: torch.Tensor, role: str, owner: str) -> Value:
        if name in self.buffers:  # one update per step: a second call would need two
            what = (
                f"calls the layer '{owner}' a second time, whose running statistics torch "
                "updates at each call and mexc once per step; give each call its own layer"
            )
            raise UnsupportedOpError(_describe(self.node, what) if self.node else what)
        arr = tensor.detach().cpu().numpy().astype(np.float32)
        node = self.b.add(
            Op.STATE, (), f32(*arr.shape), attrs(Op.STATE, name=name, role=role, owner=owner)
        )
        self.buffers[name] = arr
        return node.out

    def arg(self, a: Any) -> Value:
        if not isinstance(a, torch.fx.Node):
            raise UnsupportedOpError(f"expected a tensor argument, got {a!r}")
        if a not in self.env and a.op == "get_attr" and str(a.target).startswith(_TRACED):
            # a tensor the shape-aware trace made from shapes and read as it is (a hand-written
            # RNN's `h = torch.zeros(x.size(0), H)`): a batched constant, as x.new_zeros is
            # (random draws are refused after tracing: _refuse_drawn_constants)
            made = gather.Const(_fetch_attr(self.gm, str(a.target)).detach().clone())
            if self.is_batched_constant(made):
                self.env[a] = made
        if a not in self.env:  # a parameter or buffer read where an activation is expected
            raise UnsupportedOpError(
                _describe(
                    a,
                    "is a parameter or buffer that an operation uses as an activation (e.g. "
                    "torch.sigmoid(self.p) read by a layer); mexc trains parameters as layer "
                    "weights, scales (x * p), embeddings (x + p), class tokens, and elementwise "
                    "functions of them (sigmoid, tanh, softplus, clamp, views, indexing) that "
                    "multiply or add to an activation. Apply the function to an activation, or "
                    "fold it into the layer",
                )
            )
        v = self.env[a]
        if self.ids is not None and v == self.ids:
            raise UnsupportedOpError(
                _describe(
                    self.node if self.node is not None else a,
                    "reads the model's integer input (token ids) as an activation; mexc reads "
                    "integer inputs only whole, through embedding tables (nn.Embedding, "
                    "F.embedding): look the ids up first. For categorical columns with a table "
                    "each (emb_i(x[:, i]), emb(x + offsets)), add each column's offset in the "
                    "data and look all columns up in one table, emb(x) of [N, F, D]; or give "
                    "them as one-hot floats. If the input is images (uint8 pixels), compile "
                    "with a float example instead (x.float() / 255) and step with float images",
                )
            )
        if isinstance(v, KeyMask):
            return key_mask_activation(self, a, v)
        if isinstance(v, MaskedScores):
            raise UnsupportedOpError(
                _describe(self.node if self.node is not None else a, MASKED_READ)
            )
        if isinstance(v, RootMeanSquare):
            raise UnsupportedOpError(
                _describe(
                    self.node if self.node is not None else a,
                    f"reads the root mean square {a.name} as a tensor; {ROOT_USES}",
                )
            )
        if self.is_batched_constant(v):
            # a positional encoding made in forward for the batch (EdgeNeXt, XCiT) that a layer
            # reads: the program holds it (one row where the rows repeat) as a constant and
            # reads it as an activation, so the layer trains as over any other input
            v = gather.gathered_value(
                self, a, gather.const_gathered(a, v.value.numpy()), self.shape(a)
            )
            self.env[a] = v
        if isinstance(v, gather.Gathered):
            tokens = repeated_param(self, a, v)
            if tokens is not None:
                self.env[a] = v = tokens
        if isinstance(v, (gather.Gathered, gather.Const, gather.Concatenated)):
            what = (
                "is a parameter or buffer read through indexing"
                if isinstance(v, gather.Gathered)
                else "is parameters concatenated"
                if isinstance(v, gather.Concatenated)
                else "is a constant the forward computes without its input (from shapes or "
                "buffers: a positional encoding, a mask)"
            )
            raise UnsupportedOpError(
                _describe(
                    a,
                    f"{what}, used where mexc needs an activation (a layer or a function "
                    "applied to it); mexc adds it to an activation, multiplies one by it, or "
                    "takes it as an attention mask. Apply the layer to an activation instead",
                )
            )
        if isinstance(v, ParamView):
            raise UnsupportedOpError(
                _describe(
                    self.node if self.node is not None else a,
                    f"reads the parameter {v.source.target} (seen through a reshape) as an "
                    "activation (a function of a parameter, as torch.clamp(self.p.reshape(...))"
                    ".exp()); mexc trains parameters as layer weights, scales (x * p), "
                    "embeddings (x + p), class tokens, and elementwise functions of them "
                    "(sigmoid, tanh, softplus, clamp) that multiply or add to an activation. "
                    "Apply the function to an activation, or fold it into the layer",
                )
            )
        if isinstance(v, LayerStates):  # h_n read whole: the stack torch returns
            key = ("layer states", a)
            if key not in self.memo:
                self.memo[key] = stacked_states(self, v)
            return self.memo[key]
        if not isinstance(v, Value):
            raise UnsupportedOpError(
                _describe(
                    a,
                    "is a tuple of tensors where a tensor is used (a module's several results, "
                    "as MultiheadAttention's output and weights): index it with one integer",
                )
            )
        return v

    def is_batched_constant(self, v: Any) -> bool:
        """A float constant the forward makes whose leading axis is the input's batch."""
        return (
            isinstance(v, gather.Const)
            and v.value.is_floating_point()
            and v.value.ndim >= 2
            and int(v.value.shape[0]) in (1, self.batch)
        )

    def emit(self, op: Op, inputs: list[Value], n: torch.fx.Node, **kw: Any) -> Value:
        node = self.b.add(op, inputs, f32(*self.shape(n)), attrs(op, **kw), self.loc)
        if REGISTRY[op].keeps_axes:
            self._refuse_mixing(node, inputs, n)
        return node.out

    def _refuse_mixing(self, node: Any, inputs: list[Value], n: torch.fx.Node) -> None:
        """An op that keeps the batch axis where it is (OpDef.keeps_axes) refused where it
        would mix samples: its operands hold the batch on different axes, or it computes along
        the axis that holds it (a linear layer over a (D, N) tensor)."""
        if self.batch == 1:
            return  # one sample mixes with none (and a reshape that merges its axis of 1 into
            # the next, as a broadcast does, leaves the axis that holds it ambiguous)
        known = {a for a in map(self.batch_axis, inputs) if a is not None}
        if len(known) > 1:
            what = f"combines values whose batch axes differ ({sorted(known)})"
        elif known and not REGISTRY[node.op].keeps(node, axis := known.pop()):
            what = f"computes along axis {axis}, which holds the batch"
        else:
            return
        raise UnsupportedOpError(
            _describe(n, f"{what}: its samples would mix; move the batch axis to match first")
        )

    def emit_as(self, op: Op, inputs: list[Value], result: tuple[int, ...], **kw: Any) -> Value:
        """An op whose result (of shape `result`) is not a traced node's: a step of a
        decomposition."""
        return self.b.add(op, inputs, f32(*result), attrs(op, **kw), self.loc).out

    def describe(self, n: torch.fx.Node, what: str) -> str:
        """ "node 'x' (call_module Conv2d) at model.py:12 <what>", for error messages."""
        return _describe(n, what)

    def is_node(self, a: Any) -> bool:
        """A traced value (not a Python constant)."""
        return isinstance(a, torch.fx.Node)

    def param_view(self, a: Any) -> ParamView | None:
        """A parameter seen through a reshape (ParamView), if `a` is one."""
        held = self.env.get(a) if isinstance(a, torch.fx.Node) else None
        return held if isinstance(held, ParamView) else None

    def is_param(self, a: Any) -> bool:
        """A module parameter read directly (get_attr), e.g. a positional embedding."""
        return isinstance(a, torch.fx.Node) and a.op == "get_attr"

    def is_parameter(self, a: Any) -> bool:
        """A get_attr of one of the model's parameters (not a buffer or a traced constant)."""
        if self.parameter_names is None:
            self.parameter_names = frozenset(name for name, _ in self.gm.named_parameters())
        return str(a.target) in self.parameter_names

    def get_param(self, a: Any, role: str) -> Value:
        return _get_param(self, a, role)

    def computed_weight(self, a: Any) -> Value:
        """A convolution's weight: a module parameter, or a value computed from parameters
        alone each step (weight standardization), whose gradient the computation passes on."""
        if isinstance(a, torch.fx.Node) and a.op != "get_attr" and a in self.env:
            v = self.env[a]
            if isinstance(v, Value) and v.node not in fed_by_input(self.b.nodes):
                return v
        return _get_param(self, a, "weight")

    def fetch(self, a: Any) -> torch.Tensor:
        """The tensor a get_attr node reads (a module's parameter or buffer)."""
        return _fetch_attr(self.gm, str(a.target))

    def get_state(self, a: Any, role: str, owner: str) -> Value:
        """A module buffer read directly (get_attr) as persistent state (BN running stats)."""
        return self.state(str(a.target), _fetch_attr(self.gm, str(a.target)), role, owner)


# ----------------------------------------------------------------------------- source locations

_INTERNAL = ("/torch/", "/mexc/", "<eval_with_key>")


def _user_location(n: torch.fx.Node) -> str:
    trace = n.stack_trace or n.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        if not any(tag in path for tag in _INTERNAL):
            return f"{path.rsplit('/', 1)[-1]}:{line}"
    return ""


def _describe(n: torch.fx.Node, what: str) -> str:
    loc = _user_location(n)
    where = f" at {loc}" if loc else ""
    return f"node '{n.name}' ({n.op} {_target_name(n)}){where} {what}"


def _target_name(n: torch.fx.Node) -> str:
    t = n.target
    return getattr(t, "__name__", str(t))


# ----------------------------------------------------------------------------- handlers
# Each op's frontend patterns live in its definition (OpDef.frontend, mexc.ops); the tables below
# are built from them, plus the structural nodes that make no op (identity, contiguous).


def _identity(c: _Ctx, n: torch.fx.Node, m: Any = None) -> Value:
    return c.arg(n.args[0])


def _cast(c: _Ctx, n: torch.fx.Node) -> Value:
    """x.to(...), x.float(), x.type_as(y): the identity where the result is a float tensor of
    x's shape (a dtype or device named for the float model; mexc's values are its own)."""
    if not is_float_tensor(n):
        raise UnsupportedOpError(
            _describe(
                n, f"casts an activation to {traced_dtype(n)}; mexc trains float models' values"
            )
        )
    return c.arg(n.args[0])


@dataclass(frozen=True)
class _Pieces:
    """The result of chunk, split or unbind: pieces [start, stop) of `src` along `dim`, each a
    SLICE made when a getitem reads it (`squeeze`: unbind drops the axis)."""

    src: torch.fx.Node
    dim: int
    ranges: tuple[tuple[int, int], ...]
    squeeze: bool = False


def _pieces(c: _Ctx, n: torch.fx.Node) -> _Pieces:
    """chunk(x, chunks, dim), split(x, size_or_sizes, dim), unbind(x, dim), as functions or
    methods."""
    name = n.target if isinstance(n.target, str) else n.target.__name__
    x: Any = n.args[0]
    shape = c.shape(x)
    first = n.args[1] if len(n.args) > 1 else None
    dim_arg = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    if name == "unbind":
        dim_arg = first if first is not None else n.kwargs.get("dim", 0)
    dim = static_int(dim_arg) % len(shape)
    size = shape[dim]
    if name == "unbind":
        return _Pieces(x, dim, tuple((i, i + 1) for i in range(size)), squeeze=True)
    if name == "chunk":
        chunks = static_int(first if first is not None else n.kwargs["chunks"])
        step = -(-size // chunks)  # torch.chunk: pieces of ceil(size / chunks)
        sizes = [min(step, size - s) for s in range(0, size, step)]
    else:
        spec = first if first is not None else n.kwargs["split_size_or_sections"]
        if isinstance(spec, (list, tuple)):
            sizes = [static_int(v) for v in spec]
        else:
            sizes = [min(static_int(spec), size - s) for s in range(0, size, static_int(spec))]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return _Pieces(x, dim, tuple((s, s + k) for s, k in zip(starts, sizes)))


def _piece(c: _Ctx, n: torch.fx.Node, parts: _Pieces, index: int) -> Value:
    start, stop = parts.ranges[index]
    shape = list(c.shape(parts.src))
    if (start, stop) == (0, shape[parts.dim]):
        v = c.arg(parts.src)
    else:
        shape[parts.dim] = stop - start
        v = c.emit_as(
            Op.SLICE, [c.arg(parts.src)], tuple(shape), dim=parts.dim, start=start, stop=stop
        )
    out = c.shape(n)
    return c.emit_as(Op.RESHAPE, [v], out, shape=out) if tuple(shape) != tuple(out) else v


def _getitem(c: _Ctx, n: torch.fx.Node) -> Value | gather.Const | None:
    src, index = n.args[0], n.args[1]
    held = c.env.get(src) if isinstance(src, torch.fx.Node) else None
    if isinstance(held, _Pieces):
        values = gather.static_tensor(c, held.src)
        if values is not None:  # a piece of a constant (a RoPE table's sin and cos halves)
            start, stop = held.ranges[static_int(index)]
            part = np.take(values, np.arange(start, stop), axis=held.dim)
            part = part.squeeze(held.dim) if held.squeeze else part
            return gather.Const(torch.from_numpy(np.ascontiguousarray(part)))
        return _piece(c, n, held, static_int(index))
    if isinstance(held, LayerStates) and not isinstance(static_value(index), int):
        one = _one_state(static_value(index))  # h_n[-2, :, :]
        if one is not None:
            return _held_item(n, held, one)
        return frontend_index.read(c, n)  # of the stacked states (_Ctx.arg)
    if isinstance(held, tuple):  # a module with several results (MultiheadAttention)
        item = static_value(index)
        if isinstance(item, bool) or not isinstance(item, int):
            raise UnsupportedOpError(
                _describe(
                    n,
                    f"indexes a tuple of tensors with {item!r} (a module's several results, "
                    "as MultiheadAttention's output and weights): index it with one integer",
                )
            )
        return _held_item(n, held, item)
    if not is_traced_tensor(n):
        return None
    return frontend_index.read(c, n)


def _one_state(key: Any) -> int | None:
    """The layer-direction a key of h_n selects whole ((k, :, :), (k, ...)); None for any
    other key."""
    if not isinstance(key, tuple) or not key or isinstance(key[0], bool):
        return None
    rest = key[1:]
    whole = all(k is Ellipsis or k == slice(None) for k in rest) and len(rest) <= 2
    return key[0] if isinstance(key[0], int) and whole else None


def _named_result(c: _Ctx, n: torch.fx.Node) -> Value | None:
    """`.values` / `.indices` of a call with several results (torch.max(x, dim)); None for a
    static attribute (x.shape)."""
    src, name = n.args[0], n.args[1]
    held = c.env.get(src) if isinstance(src, torch.fx.Node) else None
    if isinstance(held, Value) and name in ("T", "mT") and is_traced_tensor(n):
        rank = len(c.shape(src))  # x.T reverses the axes, x.mT swaps the last two
        perm = (
            tuple(reversed(range(rank))) if name == "T" else (*range(rank - 2), rank - 1, rank - 2)
        )
        return transposed(c, held, tuple(c.shape(src)), perm)
    if not isinstance(held, tuple) or name not in ("values", "indices"):
        return None
    return _held_item(n, held, 0 if name == "values" else 1)


def _held_item(n: torch.fx.Node, held: tuple, index: int) -> Value | None:
    """Result `index` of a call with several results, which n reads; an error where mexc does
    not compute it (MultiheadAttention's weights, torch.max's indices) and n is used."""
    item = held[index]
    if item is None and n.users:
        raise UnsupportedOpError(
            _describe(
                n,
                f"reads result {index} of its call, which mexc does not compute (the attention "
                "weights of nn.MultiheadAttention, the indices of torch.max); use only the "
                "first result (need_weights=False)",
            )
        )
    return item


def _resolve(dotted: str) -> Any:
    """ "torch.nn.Conv2d" -> the object."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# functions of model libraries are matched by their qualified name: importing torchvision or
# timm to resolve them would slow every compile, and neither need be installed
_BY_NAME = ("torchvision.", "timm.")


def _handlers(kind: str) -> dict[Any, Callable[..., Value]]:
    out: dict[Any, Callable[..., Value]] = {}
    for d in REGISTRY.values():
        for p in d.frontend:
            if p.kind == kind:
                for t in p.targets:
                    named = kind == "method" or t.startswith(_BY_NAME)
                    out[t if named else _resolve(t)] = p.convert
    return out


def _module_handler(mod: nn.Module) -> Callable[..., Value] | None:
    """The converter of a module's class (a torch class, or a model library's by name)."""
    return MODULE_HANDLERS.get(type(mod)) or MODULE_HANDLERS.get(_qualified(type(mod)))


def _qualified(target: Any) -> str:
    name = getattr(target, "__qualname__", getattr(target, "__name__", ""))
    return f"{getattr(target, '__module__', '')}.{name}"


MODULE_HANDLERS: dict[Any, Callable[..., Value]] = {
    **_handlers("module"),
    nn.Identity: _identity,
}
FUNCTION_HANDLERS: dict[Any, Callable[..., Value]] = {
    **_handlers("function"),
    torch.clone: _identity,
}
METHOD_HANDLERS: dict[Any, Callable[..., Value]] = {
    **_handlers("method"),
    "contiguous": _identity,
    "clone": _identity,  # a new name for the same value: an in-place change of either rebinds it
    "to": _cast,
    "float": _cast,
    "type_as": _cast,
}


_TRACED = "_tensor_constant"  # the names torch.fx gives the tensors a trace makes


def _get_param(c: _Ctx, a: Any, role: str) -> Value:
    """A module parameter read directly; a buffer, or a tensor the trace made a constant
    (torch.arange(8) / 8 computed while tracing with shapes), is a frontend constant: the
    model does not train it."""
    if not isinstance(a, torch.fx.Node):
        raise UnsupportedOpError(f"a layer's {role} must be a module parameter, got {a!r}")
    if a.op != "get_attr":
        raise UnsupportedOpError(
            _describe(
                a,
                f"is used as a layer's {role} (F.conv2d, F.linear, a norm's affine), which "
                "must be a module parameter read as it is declared; keep the parameter and "
                "call the layer with it",
            )
        )
    tensor = _fetch_attr(c.gm, str(a.target))
    if not c.is_parameter(a):
        return c.constant(str(a.target), tensor.detach().cpu().numpy(), role)
    return c.param(str(a.target), tensor, role)


def _fetch_attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# nodes computing Python ints from static shapes (x.size(0), x.shape) are folded by ShapeProp
_SHAPE_METHODS = {"size", "dim"}
_PIECES = {"chunk", "split", "unbind", torch.chunk, torch.split, torch.unbind}  # getitem: SLICE


def supported_ops() -> list[str]:
    mods = [t.rsplit(".", 1)[-1] if isinstance(t, str) else t.__name__ for t in MODULE_HANDLERS]
    fns = [
        f.rsplit(".", 1)[-1] if isinstance(f, str) else getattr(f, "__name__", str(f))
        for f in FUNCTION_HANDLERS
        if not str(getattr(f, "__module__", "")).startswith("mexc.")  # mexc's own rewrites
    ]
    return sorted(set(mods)) + sorted(set(fns)) + sorted(f"Tensor.{m}" for m in METHOD_HANDLERS)


# the hooks of torch.nn.utils.weight_norm / spectral_norm, which recompute `weight` from other
# parameters before every call
_REPARAMETRIZING_HOOKS = ("WeightNorm", "SpectralNorm")


def _reparametrizations(mod: nn.Module, name: str | None = None) -> tuple[list[str], str]:
    """The kinds of reparametrization of `mod`'s weights (of its attribute `name` only, where
    given; none: []) and how to remove them."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(mod, name):
        lists: Any = mod.parametrizations
        names = [name] if name is not None else list(lists.keys())
        kinds = sorted({type(p).__name__ for k in names for p in lists[k]})
        return kinds, "torch.nn.utils.parametrize.remove_parametrizations(module, name)"
    hooks = [
        h
        for h in mod._forward_pre_hooks.values()
        if type(h).__name__ in _REPARAMETRIZING_HOOKS and name in (None, getattr(h, "name", None))
    ]
    return sorted({type(h).__name__ for h in hooks}), (
        "torch.nn.utils.remove_weight_norm / remove_spectral_norm"
    )


def _refuse_reparametrized(n: torch.fx.Node, kinds: list[str], how: str) -> None:
    """A layer whose weight is a function of other parameters (torch.nn.utils.parametrizations'
    weight_norm, spectral_norm, orthogonal, or the older weight_norm / spectral_norm hooks),
    called or read, is refused by node: mexc trains each parameter as an int8 tensor of its
    own, and the weight the layer holds at tracing would otherwise be trained (or, read as an
    attribute, frozen) in place of the parameters it comes from (another optimization, and for
    spectral_norm another model)."""
    if kinds:
        raise UnsupportedOpError(
            _describe(
                n,
                f"reads a weight computed from other parameters ({', '.join(kinds)}); mexc trains "
                f"each parameter as an int8 tensor of its own, not through a function of others. "
                f"Remove the reparametrization ({how}) to train the weight itself",
            )
        )


def _refuse_reparametrized_reads(model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """Every layer called (call_module) or weight read (get_attr: `F.linear(x, self.fc.weight)`
    of a weight-normed layer; a parametrization's own module) whose weight is reparametrized
    is refused by node. Looked up in `model`: the traced module holds a get_attr's tensor in a
    plain module of its own, without the layer's hooks."""
    for n in gm.graph.nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        path = str(n.target).split(".")
        name: str | None = None
        if "parametrizations" in path:  # module.parametrizations.weight[.original]
            at = path.index("parametrizations")
            owner, name = ".".join(path[:at]), (path[at + 1] if at + 1 < len(path) else None)
        elif n.op == "call_module":
            owner = str(n.target)
        else:
            owner, name = ".".join(path[:-1]), path[-1]
        try:
            mod = model.get_submodule(owner)
        except AttributeError:
            continue
        _refuse_reparametrized(n, *_reparametrizations(mod, name))


def _unsupported(n: torch.fx.Node, what: str) -> UnsupportedOpError:
    """One paragraph: the node, its line, and where the supported ops are listed (the list
    itself, about 300 names, made the message thousands of characters long)."""
    return UnsupportedOpError(
        f"Unsupported op {what}: {_describe(n, 'has no integer lowering in mexc')}. "
        "Replace it with a supported op or remove it from the training graph; docs/frontend.md "
        f"lists the {len(supported_ops())} supported ops and forms, and "
        "mexc.frontend.supported_ops() returns their names."
    )


# ----------------------------------------------------------------------------- tracing


class _AugmentedAssignment:
    """x += y, x -= y, x *= y, x /= y as operator.iadd ... nodes: torch changes the tensor x in
    place, which a reader of x through another name sees (sc = x; x += y; x + sc). fx's Proxy
    has no in-place methods, so Python made them x + y, and the change was lost."""

    tracer: Any

    def _augmented(self, op: Any, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    def __iadd__(self, other: Any) -> Any:
        return self._augmented(operator.iadd, other)

    def __isub__(self, other: Any) -> Any:
        return self._augmented(operator.isub, other)

    def __imul__(self, other: Any) -> Any:
        return self._augmented(operator.imul, other)

    def __itruediv__(self, other: Any) -> Any:
        return self._augmented(operator.itruediv, other)


class _OnTheHost:
    """A traced tensor's device is the CPU, where mexc runs the float model: a branch on it
    (EfficientViT's `if v.device.type != 'meta'`) goes the way it goes there, not failing as
    control flow on a traced value (or, on the meta tensors of the second try, the other way)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return False


class _Proxy(_OnTheHost, _AugmentedAssignment, torch.fx.Proxy):
    """The first try's proxy."""


class _Tracer(torch.fx.Tracer):
    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        """fx's node, with the Python stack from the model's first forward on as its
        stack_trace (where `_user_location` finds the source line of an error). Not fx's
        record_stack_traces: its first symbolized trace imports torch._inductor, 0.3 s in every
        process that traces (a data-parallel job's workers each)."""
        node = super().create_node(*args, **kwargs)
        if not node.stack_trace:
            frames = traceback.extract_stack()[:-1]
            first = next((i for i, f in enumerate(frames) if f.name == "forward"), len(frames))
            node.stack_trace = "".join(traceback.format_list(frames[first:])).strip()
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Modules with a pattern stay one call_module node (timm's DropPath, whose forward
        reads self.training and would trace as the identity in eval mode); torch's transformer
        layers are traced through mexc's forward of them (frontend_modules)."""
        if traced_forward(m) is not None or isinstance(m, nn.Embedding):
            return False  # nn.Embedding: its F.embedding reads the table by get_attr
        return _module_handler(m) is not None or super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        # every module the forward calls, traced through or not (one whose eval path makes no
        # node, a drop path returning its input, is in no node's module stack)
        self.__dict__.setdefault("called", set()).add(self.path_of_module(m))
        return super().call_module(m, traced_forward(m) or forward, args, kwargs)


class _SizeProxy(_OnTheHost, _AugmentedAssignment, MetaProxy):  # type: ignore[misc]
    """MetaProxy whose size(0) is the first axis's size (torch's tests `if dim`, so size(0)
    returned the whole shape: torchvision's Swin reshapes to x.size(0), ...), and which
    records item assignment."""

    def size(self, dim: int | None = None) -> Any:
        if dim is None:
            return super().size()
        meta = getattr(self, "_tensor_meta", None)
        if meta is not None:
            return meta.size(dim)
        return self.tracer.create_proxy("call_method", "size", (self, dim), {})

    @property
    def ndim(self) -> Any:
        """The example's rank, as MetaProxy gives dim() (Meta LLaMA's reshape_for_broadcast
        asserts on x.ndim)."""
        meta = getattr(self, "_tensor_meta", None)
        if meta is not None:
            return meta.ndim
        return self.tracer.create_proxy("call_function", getattr, (self, "ndim"), {})

    def __setitem__(self, key: Any, value: Any) -> None:
        """t[key] = value as an operator.setitem node (torchvision's Swin writes its window
        mask so), which the frontend folds where t is a constant."""
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class _ShapeTracer(MetaTracer, _Tracer):
    """The second try for a model whose Python branches on shapes (timm's MobileViT: `if
    new_h != H`), which plain symbolic tracing cannot follow: torch.fx's MetaTracer carries a
    meta tensor with every proxy, so `x.shape` and `x.size()` are the example's ints and such a
    branch goes the way the example takes it. The graph is for the example's shape, as every
    mexc graph is; a branch on tensor values still fails."""

    def proxy(self, node: torch.fx.Node) -> _SizeProxy:
        return _SizeProxy(node, self)

    # MetaTracer installs a module that forward creates (nn.ReLU() inline) into the model; the
    # user's model stays as it is, and such a module fails as in the first try
    allow_insert_stateless_mods = False

    def create_proxy(
        self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **named: Any
    ) -> Any:
        """MetaTracer's proxy, with its meta result computed again where MetaTracer could not
        because an argument was a real tensor (a module buffer that F.batch_norm reads)."""
        rv = super().create_proxy(kind, target, args, kwargs, *rest, **named)
        if kind not in ("call_function", "call_method", "call_module"):
            return rv
        if getattr(rv, "_tensor_meta", None) is not None:
            return rv
        self._disable_module_getattr = True  # the module's own tensors, not proxies of them
        try:
            a, k = torch.fx.node.map_aggregate((args, kwargs), _as_meta)
            if kind == "call_function":
                meta = manual_meta_overrides.get(target, target)(*a, **k)
            elif kind == "call_method":
                meta = getattr(a[0], target)(*a[1:], **k)
            else:
                meta = _on_meta(self.root.get_submodule(target)).forward(*a, **k)
        except Exception:  # noqa: BLE001 - no meta: shapes stay symbolic there
            return rv
        finally:
            self._disable_module_getattr = False
        if isinstance(meta, torch.Tensor):
            rv.install_tensor_meta(meta)
        return rv


def _on_meta(mod: nn.Module) -> nn.Module:
    """A shallow copy of leaf module `mod` with its parameters and buffers on the meta device
    (no data copied: a large Linear costs nothing)."""
    meta = copy.copy(mod)
    meta._parameters = {
        k: None if v is None else nn.Parameter(v.to("meta"), v.requires_grad)
        for k, v in mod._parameters.items()
    }
    meta._buffers = {k: None if v is None else v.to("meta") for k, v in mod._buffers.items()}
    return meta


def _as_meta(v: Any) -> Any:
    """A traced value's meta tensor, a real tensor moved to the meta device."""
    if isinstance(v, MetaDeviceAttribute):
        return "meta"
    if isinstance(v, torch.fx.Proxy):
        meta = getattr(v, "_tensor_meta", None)
        if meta is None:
            raise ValueError("no meta")
        return meta
    return v.to("meta") if isinstance(v, torch.Tensor) else v


def _trace_with_shapes(
    tracer: _ShapeTracer, model: nn.Module, example: torch.Tensor, concrete: dict[str, Any]
) -> torch.fx.Graph | Exception:
    """The graph of `model` traced with the example's shapes known, or the error where that
    fails too."""
    first = next(iter(inspect.signature(model.forward).parameters))
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # MetaTracer warns for every call whose meta result it cannot compute; the
            # shape propagation after tracing reports what matters
            warnings.simplefilter("ignore")
            meta = {first: example.to("meta")}
            return tracer.trace(model, meta_args=meta, concrete_args=concrete or None)
    except Exception as err:  # noqa: BLE001 - any failure: reported with the first try's
        return err


# torch's functions that draw random numbers. Called on known sizes (literal, or the example's
# under the shape-aware trace) they return a tensor, which tracing keeps as a constant: one draw,
# read in every step. While mexc traces, what they return is a _Drawn tensor, and so is what
# is computed from it (torch keeps a subclass through its ops: `torch.rand(n, 8) > 0.5`).
_RANDOM_DRAWS = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "poisson")


class _Drawn(torch.Tensor):
    """A tensor drawn at random, or computed from one, while mexc traces."""


@contextlib.contextmanager
def _marking_random_draws() -> Iterator[None]:
    """torch's random draws return _Drawn tensors while this is active."""
    saved = {name: getattr(torch, name) for name in _RANDOM_DRAWS}

    def marking(draw: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(draw)
        def drawn(*args: Any, **kwargs: Any) -> Any:
            out = draw(*args, **kwargs)
            return out.as_subclass(_Drawn) if type(out) is torch.Tensor else out

        return drawn

    for name, draw in saved.items():
        setattr(torch, name, marking(draw))
    try:
        yield
    finally:
        for name, draw in saved.items():
            setattr(torch, name, draw)


def _refuse_drawn_constants(gm: torch.fx.GraphModule) -> None:
    """A random draw the trace kept as a constant (`h + torch.randn(x.size(0), 8)`), refused
    at its first reader: the program would add the same numbers in every step."""
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not isinstance(_fetch_attr(gm, str(n.target)), _Drawn):
            continue
        reader = next(iter(n.users), n)
        raise UnsupportedOpError(
            _describe(
                reader,
                "reads random numbers the forward draws (torch.randn, torch.rand, ...): tracing "
                "draws them once, so the program would read the same numbers in every step. "
                "mexc draws no random numbers but dropout's: draw the noise in the data, or "
                "use nn.Dropout",
            )
        )


@contextlib.contextmanager
def _through_library_wraps() -> Iterator[None]:
    """torchvision marks functions of its models as leaves of symbolic tracing (torch.fx.wrap:
    Swin's shifted_window_attention, _get_relative_position_bias, _patch_merging_pad); mexc
    has no converter for such a call, but it has one for every op in its body. While mexc
    traces, those without a converter are traced through (torch.fx's table of wrapped
    functions without them), and the table is restored after."""
    table = torch.fx._symbolic_trace._wrapped_fns_to_patch
    saved = dict(table)
    for key, frame in saved.items():
        module = str(frame.get("__name__", ""))
        if module.startswith("torchvision.models.") and f"{module}.{key[1]}" not in (
            FUNCTION_HANDLERS
        ):
            del table[key]
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def trace(
    model: nn.Module, example: torch.Tensor, in_eval_mode: frozenset[str] = frozenset()
) -> torch.fx.GraphModule:
    """symbolic_trace with source locations and a clear error for dynamic control flow; the
    submodules named in `in_eval_mode` (frontend_eval_modes.eval_submodules, read before the
    model was put in eval mode for tracing) run as torch runs them in eval mode."""
    own = set(model.__dict__)
    try:
        with _through_library_wraps(), _marking_random_draws():
            gm = _trace(model, example)
        _refuse_drawn_constants(gm)
    finally:
        # fx keeps each tensor the forward makes (a constant of a buffer) as an attribute of the
        # traced module, the user's; the GraphModule holds its own reference
        for name in set(model.__dict__) - own:
            if name.startswith(_TRACED):
                del model.__dict__[name]
    if apply_eval_modes(gm, in_eval_mode):
        _propagate(gm, model, example)  # the written-out batch norms' nodes
    if complex_as_pairs(gm, _describe):
        _propagate(gm, model, example)
    while resampling_as_products(gm):  # again: a resampling of one rewritten has no shape yet
        _propagate(gm, model, example)
    _drop_float_casts(gm)
    if gains_in_place(gm):
        _propagate(gm, model, example)
    if lift_parameter_functions(gm, int(example.shape[0]) if example.ndim else 1):
        _propagate(gm, model, example)
    return gm


# Tensor methods that, from a float tensor to a float tensor of its shape, change only the
# dtype, device or layout: mexc's values are its own, so they are the identity
_FLOAT_CASTS = frozenset(
    ("to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "cpu", "cuda")
)


def _writes_in_place(user: torch.fx.Node, n: torch.fx.Node) -> bool:
    """`user` writes into n in place (n.add_(y), n += y)."""
    first = user.args[0] if user.args else None
    return first is n and (user.target in _AUGMENTED or _underscored(user))


def _drop_float_casts(gm: torch.fx.GraphModule) -> None:
    """Casts of a float tensor to a float dtype (`p.to(x.dtype)`, `x.float()`, `.contiguous()`)
    taken out of the graph, their users reading the tensor itself: so a parameter cast before
    it is added (NaFlexViT's `pos_embed.to(x.dtype)`), or a mean of squares cast inside a
    written-out norm, is read as the tensor it is. Casts from or to other dtypes (ids, masks)
    stay for the frontend's rules, and so does a cast that makes a copy (another float dtype,
    a contiguous copy) which is then written in place: a write into the copy must not reach
    the tensor."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_method" or n.target not in _FLOAT_CASTS or not n.args:
            continue
        src = n.args[0]
        if not (isinstance(src, torch.fx.Node) and is_float_tensor(n) and is_float_tensor(src)):
            continue
        if n.meta["tensor_meta"].shape != src.meta["tensor_meta"].shape:
            continue
        returns_self = n.target != "contiguous" and traced_dtype(n) == traced_dtype(src)
        if returns_self or not any(_writes_in_place(u, n) for u in n.users):
            for u in n.users if n.target == "contiguous" else ():
                if u.op == "call_method" and u.target == "view":
                    # x.transpose(1, 2).contiguous().view(...): a view of a non-contiguous
                    # tensor fails when shapes are propagated again (lifted parameters); a
                    # reshape is the same op to mexc, and may share memory as the view did
                    u.target = "reshape"
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            changed = True
    if changed:
        gm.recompile()


def _trace(model: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    tracer = _Tracer()
    # forward's optional arguments (timm's attn_mask=None) keep their defaults: the model
    # takes one tensor
    params = list(inspect.signature(model.forward).parameters.values())[1:]
    concrete = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as err:  # noqa: BLE001 - anything symbolic tracing trips over
        # Python on a traced value (a branch, int(), math.sqrt of a size): known shapes may
        # resolve it; anything else gets the model's error in one paragraph, not a traceback
        tracer = _ShapeTracer()
        traced = _trace_with_shapes(tracer, model, example, concrete)
        if isinstance(traced, Exception):
            message = _control_flow_message(model, err) + _later_failure(err, traced)
            raise TraceError(message) from None
        graph = traced
    _refuse_fx_name_clashes(model, graph)
    try:
        gm = torch.fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    except (SyntaxError, TypeError, AttributeError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else ""
        raise TraceError(
            f"{type(model).__name__} cannot be traced: torch.fx could not build a module from "
            f"its graph ({type(err).__name__}: {first})"
        ) from None
    gm.meta[MODULES_CALLED] = frozenset(getattr(tracer, "called", ()))
    _propagate(gm, model, example)
    return gm


@functools.cache
def _graph_module_names() -> frozenset[str]:
    """What GraphModule adds to nn.Module's attributes (graph, code, meta, recompile, ...):
    fx's module reads each submodule, parameter and buffer as `self.<name>`, so one named so
    at the top level is shadowed by it (a nested `block.meta` is read from a plain module)."""
    scratch = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    own = set(dir(torch.fx.GraphModule)) | set(vars(scratch))
    return frozenset(own - set(dir(nn.Module)) - set(vars(nn.Module())))


def _refuse_fx_name_clashes(model: nn.Module, graph: torch.fx.Graph) -> None:
    """A keyword anywhere in a path the graph reads does not compile (`self.block.class`);
    a GraphModule attribute as its first part is shadowed."""
    clashes = {}
    for n in graph.nodes:
        if n.op not in ("call_module", "get_attr"):
            continue
        parts = str(n.target).split(".")
        bad = [p for p in parts if keyword.iskeyword(p)]
        bad += [parts[0]] if parts[0] in _graph_module_names() else []
        if bad:
            clashes[str(n.target)] = bad[0]
    if clashes:
        named = ", ".join(f"'{target}' ('{part}')" for target, part in sorted(clashes.items()))
        raise TraceError(
            f"{type(model).__name__} cannot be traced: torch.fx reads every submodule, parameter "
            "and buffer the forward uses as an attribute of the module it builds, so a name that "
            "is a Python keyword, or at the top level an attribute of torch.fx.GraphModule "
            f"(graph, code, meta, recompile, ...), cannot be one. Rename {named}"
        )


def _propagate(gm: torch.fx.GraphModule, model: nn.Module, example: torch.Tensor) -> None:
    """Every node's shape and dtype (tensor_meta), and the values of size arithmetic."""
    if _propagate_on_meta(gm, example):
        return
    prop = _ShapeProp(gm)
    try:
        # no autograd: it would keep every activation of the float forward alive at once (at
        # batch 128 a SmallResNet's propagation peaked at 90 MB, more than its integer step)
        with torch.no_grad():
            prop.propagate(example)
    except Exception as err:  # noqa: BLE001 - report the model's own failure plainly
        raise InputError(_example_failure(model, example, prop.failed, err)) from None


def _propagate_on_meta(gm: torch.fx.GraphModule, example: torch.Tensor) -> bool:
    """Shapes and dtypes of every node from a copy of `gm` on the meta device (no data): a
    float forward at the full batch set the compile's peak RSS (FashionCNN at batch 128: about
    95 KiB per sample, twice the integer step's). False where an op has no meta kernel or the
    model fails; the real propagation then runs, and reports the model's own error."""
    try:
        meta = copy.deepcopy(gm).to("meta")
        with torch.no_grad():
            _ShapeProp(meta).propagate(example.to("meta"))
    except Exception:  # noqa: BLE001 - any failure: the real propagation decides
        return False
    for real, fake in zip(gm.graph.nodes, meta.graph.nodes):
        for key in ("tensor_meta", "type", STATIC_VALUE):
            if key in fake.meta:
                real.meta[key] = fake.meta[key]
    return True


class _ShapeProp(ShapeProp):
    """ShapeProp that remembers the node it failed on, and prints nothing. torch's ShapeProp
    prints the failing node's traceback to stderr before it raises; mexc reports the failure
    in one paragraph instead (or, on the meta device, tries again on the real one)."""

    failed: torch.fx.Node | None = None

    def propagate(self, *args: Any) -> Any:
        saved = shape_prop.traceback
        shape_prop.traceback = types.SimpleNamespace(print_exc=lambda *a, **k: None)  # type: ignore[assignment]
        try:
            return super().propagate(*args)
        finally:
            shape_prop.traceback = saved

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception:
            self.failed = n
            raise
        if _is_number(result):  # a size, or arithmetic on sizes: its value for converters
            n.meta[STATIC_VALUE] = tuple(result) if isinstance(result, torch.Size) else result
        return result


def _is_number(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_is_number(x) for x in v)
    return isinstance(v, (int, float)) and not isinstance(v, torch.Tensor)


def _example_failure(
    model: nn.Module, example: torch.Tensor, node: torch.fx.Node | None, err: Exception
) -> str:
    """One paragraph: the node, its source line, the model's own error (ShapeProp wraps it
    with the node's whole metadata), and what to do."""
    cause = err.__cause__ or err
    at = f" at {_describe(node, '')}".rstrip() if node is not None else ""
    return (
        f"running {type(model).__name__} on an example input of shape "
        f"{tuple(example.shape)} (dtype {example.dtype}) failed{at}: "
        f"{type(cause).__name__}: {str(cause).strip()}. Give an example input of the shape "
        "and dtype the model expects (--input-shape on the command line, example_inputs in "
        "Python)."
    )


def _user_site(err: BaseException) -> str:
    """ " at model.py:12 (the line)" of the model's own frame err was raised under, or ""."""
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if not any(t in f.filename for t in _INTERNAL)]
    if not user:
        return ""
    return f" at {user[-1].filename.rsplit('/', 1)[-1]}:{user[-1].lineno} ({user[-1].line})"


def _later_failure(first: Exception, second: Exception) -> str:
    """The shape-aware retrace's failure, where it got past the first try's line and failed
    on another: the first line is then not what stops the model (a star-unpacked shape,
    which known shapes resolve, before Meta LLaMA's enumerate(x.shape) of a complex tensor)."""
    site = _user_site(second)
    if not site or site == _user_site(first):
        return ""
    text = " ".join(str(second).split())
    return (
        f" With the example's shapes known, tracing gets past that line and fails{site}: "
        f"{type(second).__name__}: {text[:300]}"
    )


def _control_flow_message(model: nn.Module, err: Exception) -> str:
    where = _user_site(err)
    control_flow = isinstance(err, torch.fx.proxy.TraceError) or (
        "symbolically traced variables" in str(err) or "Proxy" in type(err).__name__
    )
    if not control_flow:
        return (
            f"{type(model).__name__} could not be traced{where}: {type(err).__name__}: {err}. "
            "mexc traces the forward symbolically (torch.fx), with tensors standing in for "
            "values, and then once more with the example's shapes known. Python that needs a "
            "tensor's value (int(t), math.sqrt(t), a loop over it) fails there; compute such "
            "numbers from shapes (x.shape) or constants instead."
        )
    if "cannot be iterated" in str(err):  # a loop or a generator over a tensor, not a branch
        return (
            f"{type(model).__name__} iterates over a tensor{where}. mexc traces the model "
            "symbolically (torch.fx), where a tensor, or the result of chunk or split, has no "
            "length to loop over. Unpack a fixed number of parts instead (q, k, v = "
            "t.chunk(3, dim=-1)), or index them (parts[0])."
        )
    return (
        f"{type(model).__name__} has data-dependent control flow{where}: {err}. mexc compiles a "
        "static training graph, so branches and loops may depend only on shapes and constants, "
        "not on tensor values. Rewrite the branch with tensor ops or make it static."
    )


def _static(c: _Ctx, n: torch.fx.Node) -> bool:
    """n computes a Python value from static shapes only (x.size(1) // groups, h == 224, a
    torch._assert on them): shape propagation already ran it on the example, so it needs no
    op. A value that depends on tensor data (x.sum().item()) is not static."""
    if is_traced_tensor(n):
        return False
    if n.op == "call_function" and n.target is getattr:
        ok = True  # x.shape, x.ndim, x.dtype
    elif n.op == "call_method" and n.target in ("size", "dim"):
        ok = True
    else:
        args: list[Any] = []
        torch.fx.node.map_arg((n.args, n.kwargs), args.append)
        ok = all(a in c.static for a in args)
    if ok:
        c.static.add(n)
    return ok


def _translate(c: _Ctx, n: torch.fx.Node) -> Any:
    if n.op in ("call_function", "call_method") and _static(c, n):
        return None
    folded = frontend_fold.fold(c, n)  # a parameter read through indexing, integer buffers
    if folded is not None:
        return folded
    if n.op in ("call_function", "call_method"):
        # numbers computed from shapes ((C // heads) ** -0.5) reach converters as numbers
        n.args, n.kwargs = torch.fx.node.map_arg(
            (n.args, n.kwargs), lambda a: static_value(a) if a in c.static else a
        )
        _canonical_arguments(n)
    if n.op == "call_module":
        mod = c.gm.get_submodule(str(n.target))
        n.meta["mexc_module"] = type(mod).__name__  # frontend_index._is_view reads it
        handler = _module_handler(mod)
        if handler is None:
            raise _unsupported(n, type(mod).__name__)
        return _rebound_if_in_place(c, n, handler(c, n, mod), getattr(mod, "inplace", False))
    if n.op == "call_function":
        if n.target is getattr:
            return _named_result(c, n)  # x.shape: None; torch.max(x, d).values
        if n.target in _PIECES:
            return _pieces(c, n)  # read by getitem
        if n.target is operator.getitem:
            return _getitem(c, n)
        if n.target is operator.setitem:
            frontend_index.write(c, n)  # binds the written node to its new value
            return None
        fhandler = FUNCTION_HANDLERS.get(n.target) or FUNCTION_HANDLERS.get(_qualified(n.target))
        if fhandler is None:
            return _in_place(c, n)
        # F.leaky_relu_(x), x += y (operator.iadd) change x as F.relu(x, inplace=True) does
        changes = n.target in _AUGMENTED or _underscored(n) or _inplace_argument(n)
        return _rebound_if_in_place(c, n, fhandler(c, n), changes)
    if n.op == "call_method":
        if n.target in _SHAPE_METHODS:
            return None
        if n.target in _PIECES:
            return _pieces(c, n)
        mhandler = METHOD_HANDLERS.get(str(n.target))
        if mhandler is None:
            return _in_place(c, n)
        return _rebound_if_in_place(c, n, mhandler(c, n), _underscored(n))
    if n.op == "get_attr":
        return None  # parameters are materialized by their consumers
    raise _unsupported(n, n.op)


# torch's NumPy-style aliases (x.sum(axis=1), x.chunk(2, axis=-1), x.swapaxes(axis0=...)):
# the converters read torch's own names
_KEYWORD_ALIASES = {"axis": "dim", "keepdims": "keepdim", "axis0": "dim0", "axis1": "dim1"}


# the leading parameters, after the tensor itself, that converters read by position, and the
# names torch's keyword forms give them (x.transpose(dim0=1, dim1=2), torch.mean(input=x))
_POSITIONAL: dict[str, tuple[tuple[str, ...], ...]] = {
    "transpose": (("dim0",), ("dim1",)),
    "swapaxes": (("dim0",), ("dim1",)),
    "swapdims": (("dim0",), ("dim1",)),
    "permute": (("dims",),),
    "split": (("split_size", "split_size_or_sections"), ("dim",)),
    "chunk": (("chunks",), ("dim",)),
    "repeat": (("repeats",),),
    "matmul": (("other",),),
    "add": (("other",),),
    "sub": (("other",),),
    "mul": (("other",),),
    "div": (("other",),),
    "true_divide": (("other",),),
    "bmm": (("mat2",),),
    "mm": (("mat2",),),
}


def _canonical_arguments(n: torch.fx.Node) -> None:
    """n's keyword arguments in the forms the converters read: torch's names for the NumPy
    aliases, the tensor (`input=`, `tensors=`) first, and the leading parameters of _POSITIONAL
    by position."""
    kwargs = {
        _KEYWORD_ALIASES.get(k, k) if _KEYWORD_ALIASES.get(k) not in n.kwargs else k: v
        for k, v in n.kwargs.items()
    }
    args = list(n.args)
    # torch.where(condition=c, input=x, other=y): its first parameter is not `input`
    if not args and n.op == "call_function" and "condition" not in kwargs:
        for first in ("input", "tensors"):
            if first in kwargs:
                args.append(kwargs.pop(first))
                break
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    for at, names in enumerate(_POSITIONAL.get(name, ()), start=1):
        given = [k for k in names if k in kwargs]
        if len(args) > at:  # given by position
            continue
        if len(args) < at or not given:
            break
        args.append(kwargs.pop(given[0]))
    n.args, n.kwargs = tuple(args), kwargs


def _translated(c: _Ctx, n: torch.fx.Node) -> Any:
    """_translate(c, n), its result checked against the traced shape: a converter that
    misread an argument (a keyword form it does not know) is refused here, by node, rather
    than computing another tensor; and a converter's failure on arguments it did not expect is
    one error naming the node, not a traceback from inside it."""
    try:
        value = _translate(c, n)
    except MexcError:
        raise
    except (IndexError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise UnsupportedOpError(
            _describe(
                n,
                f"could not be converted: mexc's converter failed on its arguments "
                f"({type(err).__name__}: {err}); pass them as torch's documentation orders "
                "them (positionally), and report this if it persists",
            )
        ) from None
    if isinstance(value, Value) and n.op != "get_attr":
        meta = n.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            c.batch_axis(value)  # brings c.types up to date
            got, want = c.types[value].shape, tuple(int(d) for d in meta.shape)
            if got != want:
                raise UnsupportedOpError(
                    _describe(
                        n,
                        f"was converted to a tensor of shape {list(got)}, where torch computes "
                        f"{list(want)}: mexc misread its arguments ({_argument_text(n)}); pass "
                        "them as torch's documentation orders them (positionally), and report "
                        "this if it persists",
                    )
                )
    return value


def _argument_text(n: torch.fx.Node) -> str:
    args = [a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args]
    kwargs = [
        f"{k}={v.name if isinstance(v, torch.fx.Node) else repr(v)}" for k, v in n.kwargs.items()
    ]
    return ", ".join(args + kwargs)


def _in_place(c: _Ctx, n: torch.fx.Node) -> Value:
    """x.add_(y), x.mul_(s), x.clamp_(...), x.relu_(), torch.relu_(x) on an activation: the
    op without its underscore, and x's node rebound to the result (as a write into x: refused
    where a view of x would miss it); an error naming the op where there is none."""
    pure, target = _pure_of(n)
    if pure is None:
        raise _unsupported(n, f"Tensor.{n.target}" if n.op == "call_method" else _target_name(n))
    x = n.args[0] if n.args else n.kwargs.get("input")
    if isinstance(x, torch.fx.Node) and not isinstance(c.env.get(x), Value):
        raise UnsupportedOpError(_describe(n, _NOT_ACTIVATION))
    held, n.target = n.target, target  # converters read the op's name (x.clamp_ as x.clamp)
    try:
        v = pure(c, n)
    finally:
        n.target = held
    return _rebound_if_in_place(c, n, v, True)


def _rebound_if_in_place(c: _Ctx, n: torch.fx.Node, v: Any, inplace: Any) -> Any:
    """v, the result of a layer or function called with inplace=True (nn.ReLU(inplace=True),
    F.relu(x, inplace=True)), is also the new value of its input's node: torch changed the
    input, and a later reader of it (y + relu_(y)) reads the changed tensor."""
    if inplace is not True:
        return v
    x = n.args[0] if n.args else n.kwargs.get("input")
    if not isinstance(x, torch.fx.Node):
        return v
    # masked_fill_ binds the activation to its masked scores (ops.attention.MaskedScores)
    held = (Value, MaskedScores)
    if not isinstance(c.env.get(x), held) or not isinstance(v, held):
        raise UnsupportedOpError(_describe(n, _NOT_ACTIVATION))
    frontend_index.rebind(c, n, x, v)
    return v


_NOT_ACTIVATION = (
    "changes a parameter, a buffer or a constant in place; mexc changes only activations in place"
)

# augmented assignments (the ones _AugmentedAssignment traces): x += y changes x in place
_AUGMENTED = frozenset((operator.iadd, operator.isub, operator.imul, operator.itruediv))


def _underscored(n: torch.fx.Node) -> bool:
    """An in-place op by torch's naming: x.add_(y), F.leaky_relu_(x), torch.relu_(x). Python's
    operators are not (operator.and_ is `a & b`); its augmented ones are _AUGMENTED."""
    if n.op == "call_function" and getattr(n.target, "__module__", "") in ("_operator", "operator"):
        return False
    name = called_name(n)
    return name.endswith("_") and not name.endswith("__") and len(name) > 1


def _inplace_argument(n: torch.fx.Node) -> Any:
    """A function call's `inplace` argument, by keyword or by position (F.relu(x, True))."""
    if "inplace" in n.kwargs:
        return static_value(n.kwargs["inplace"])
    try:
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature, or other arguments
        return False
    return static_value(bound.arguments.get("inplace", False))


def _pure_of(n: torch.fx.Node) -> tuple[Callable[..., Value] | None, Any]:
    """The converter of an in-place op's pure form, and that form's target (None, None where
    n is not an in-place op mexc converts)."""
    if not _underscored(n):
        return None, None
    name = called_name(n)
    if n.op == "call_method":
        return METHOD_HANDLERS.get(name[:-1]), name[:-1]
    for home in (torch, torch.nn.functional):
        pure = getattr(home, name[:-1], None)
        handler = FUNCTION_HANDLERS.get(pure) if pure is not None else None
        if handler is not None:
            return handler, pure
    return None, None


# casts that leave integer ids as they are (`self.emb(ids.long())`)
_ID_CASTS = {"long", "int", "to", "contiguous", "type_as", "clone"}


def _passes_ids_on(c: _Ctx, n: torch.fx.Node) -> bool:
    """n casts the integer input to int32 or int64 (ids.long()): it is the ids. A cast to a
    narrower integer type, which would wrap the larger ids, is refused."""
    if not (n.op == "call_method" and n.target in _ID_CASTS and n.args):
        return False
    meta = n.meta.get("tensor_meta")
    dtype = getattr(meta, "dtype", None)
    if not c.is_token_ids(n.args[0]) or dtype is None or dtype.is_floating_point:
        return False
    if dtype not in (torch.int32, torch.int64):
        raise UnsupportedOpError(
            _describe(
                n,
                f"casts the token ids to {dtype}, which wraps the ids beyond its range (the "
                "program reads them as they are); cast them to torch.long or torch.int",
            )
        )
    return True


def _with_vocabulary(c: _Ctx, n: torch.fx.Node) -> None:
    """Set the integer input's vocabulary [0, V): V the fewest rows of the embedding tables
    that read it (the host checks every batch against it). Any other read was refused where it
    happened (_Ctx.arg)."""
    types = {v.out: v.types[0] for v in c.b.nodes}
    rows = [
        int(types[node.inputs[1]].shape[0])
        for node in c.b.nodes
        if node.op is Op.EMBEDDING and node.inputs[0] == c.ids and node.inputs[1] not in c.id_masks
    ]
    if not rows:
        raise UnsupportedOpError(
            _describe(
                n,
                "is an integer input that no embedding table reads; mexc reads integer inputs "
                "(token ids) through nn.Embedding or F.embedding of a parameter, and floats "
                "otherwise: pass float data, or look the ids up in a table",
            )
        )
    at = next(i for i, node in enumerate(c.b.nodes) if node.op is Op.INPUT)
    node = c.b.nodes[at]
    c.b.nodes[at] = dataclasses.replace(
        node, attrs=attrs(Op.INPUT, name=str(node.attrs.name), vocab=min(rows))
    )
    fill_tables(c, min(rows))


def _following_root(c: _Ctx, n: torch.fx.Node) -> RootMeanSquare | None:
    """The root mean square n computes (mexc.ops.norm_written_out), with n's location."""
    c.node = n
    return follow(c, n)


def _drop_dead_nodes(c: _Ctx, outputs: list[Value]) -> None:
    """Drop the nodes the outputs do not need: results a model computes and never uses
    (`unused = h * h`), and what a converter computed but a later one did not use (the norm of
    `x / x.norm(...)`, whose quotient is computed whole). A parameter read only there goes
    too: torch never updates it (its gradient is None), and neither does the program. Kept
    although nothing reads them: the input and labels, and a node that reads persistent state
    (a batch norm's running statistics, which torch updates whether or not its output is used)."""
    by_id = {n.id: n for n in c.b.nodes}
    state = {n.id for n in c.b.nodes if n.op is Op.STATE}
    live: set[int] = set()
    todo = [v.node for v in outputs] + [
        n.id
        for n in c.b.nodes
        if n.op in (Op.INPUT, Op.LABEL) or any(v.node in state for v in n.inputs)
    ]
    while todo:
        i = todo.pop()
        if i not in live:
            live.add(i)
            todo.extend(v.node for v in by_id[i].inputs)
    dead = [n for n in c.b.nodes if n.id not in live]
    c.b.nodes[:] = [n for n in c.b.nodes if n.id in live]
    for n in dead:
        if n.op is Op.PARAM:
            c.params.pop(str(n.attrs.name), None)
            c.constants.discard(str(n.attrs.name))
        elif n.op is Op.STATE:
            c.buffers.pop(str(n.attrs.name), None)


def _rows_per_sample(
    c: _Ctx, n: torch.fx.Node, logits: Value, shape: tuple[int, ...], samples: int
) -> tuple[Value, tuple[int, ...]]:
    """Logits whose first axis holds each sample's k positions merged with the batch
    (`logits.view(B * T, V)`, nanoGPT's loss view; a per-pixel head's
    `permute(0, 2, 3, 1).reshape(-1, C)`) as [N, C, k, ...], the model's "logits" output: a
    label per position, the rows sample-major as the merge made them (the loss reads the
    rows themselves). Only a merge with the batch outermost keeps it
    (ops.common.reshaped_batch_axis); one that lost it (positions first: (T, B, V) viewed
    as (T * B, V)) is refused, as its rows are not the samples'."""
    if c.batch_axis(logits) is None:
        raise UnsupportedOpError(
            _describe(
                n,
                f"returns logits of {shape[0]} rows for a batch of {samples}, merged from axes "
                "where the batch is not the outermost (positions first: a (T, B, V) tensor "
                "viewed as (T * B, V)), so its rows are not each sample's in turn; return "
                "[B, V, T] logits (batch first, classes on axis 1), as F.cross_entropy reads "
                "them with [B, T] labels",
            )
        )
    k = shape[0] // samples
    split = reshaped(c, logits, (samples, k, *shape[1:]))
    moved = (samples, shape[1], k, *shape[2:])
    perm = (0, 2, 1, *range(3, len(shape) + 1))
    return transposed(c, split, (samples, k, *shape[1:]), perm), moved


def import_model(model: nn.Module, example: torch.Tensor) -> FrontendResult:
    """Trace `model` on `example` (a float batch, or integer ids that embedding tables read)
    and build the float mexc graph with the loss head.

    The graph computes logits, then softmax cross-entropy against integer labels (one per
    sample, or one per position of [N, C, d1, ...] logits: graph attribute LABEL_SHAPE);
    outputs are "logits", "probs" and "loss".
    """
    modes = {m: m.training for m in model.modules()}
    in_eval_mode = eval_submodules(model)  # frozen batch norms: before model.eval() hides them
    model.eval()  # tracing must not update BN running stats
    try:
        gm = trace(model, example, in_eval_mode)
    finally:
        set_modes(modes)  # leave the user's module as it was, frozen parts too
    if branches := training_branches(model, gm, in_eval_mode):
        warnings.warn(
            "mexc traces the model in eval mode, so where the model's own code reads "
            "self.training (a branch on it, an argument) it took the eval-mode path, in the "
            f"training step too: {', '.join(branches)}. Where training must differ from "
            "evaluation there, write it without reading the flag (mexc trains nn.Dropout, "
            "F.dropout and batch norms as in training itself).",
            stacklevel=3,
        )
    _refuse_reparametrized_reads(model, gm)
    b = GraphBuilder()
    c = _Ctx(gm, b)
    c.position = {n: i for i, n in enumerate(gm.graph.nodes)}
    logits: Value | None = None
    logits_node: torch.fx.Node | None = None
    ids_node: torch.fx.Node | None = None  # the integer input, where it is one
    for n in gm.graph.nodes:
        c.loc = _user_location(n)
        if n.op == "placeholder":
            if c.env and not is_traced_tensor(n):
                c.static.add(n)  # an optional argument traced at its default (concrete_args)
                continue
            if c.env:
                raise UnsupportedOpError("mexc models take exactly one input tensor")
            if example.is_floating_point():
                node = b.add(Op.INPUT, (), f32(*c.shape(n)), attrs(Op.INPUT, name=n.name))
            else:  # its vocabulary is set once the tables that read it are known
                ids = TensorType(Kind.I64, tuple(c.shape(n)))
                node = b.add(Op.INPUT, (), ids, attrs(Op.INPUT, name=n.name, vocab=0))
                c.ids, ids_node = node.out, n
            c.env[n] = node.out
            c.batch = c.shape(n)[0] if c.shape(n) else 0
        elif n.op == "output":
            out = n.args[0]
            if not isinstance(out, torch.fx.Node):
                kind = type(out).__name__
                raise UnsupportedOpError(
                    c.describe(
                        n,
                        f"returns a {kind}, not one tensor; mexc trains on one logits tensor: "
                        "return the logits alone, or wrap the model in a module whose forward "
                        "returns them (model(x)[0], model(x)['logits'])",
                    )
                )
            logits, logits_node = c.env[out], out
            if isinstance(logits, RootMeanSquare):
                raise UnsupportedOpError(_describe(out, f"is a root mean square; {ROOT_USES}"))
            if isinstance(logits, (KeyMask, MaskedScores)):
                raise UnsupportedOpError(
                    _describe(
                        out,
                        "is the model's output, a mask of the token ids or scores a masked_fill "
                        "set to -inf; return the logits themselves",
                    )
                )
        elif _passes_ids_on(c, n):
            c.env[n] = c.ids
        elif c.ids is not None and (mask := key_mask_of(c, n)) is not None:
            c.env[n] = mask
        elif (masked := masked_scores(c, n)) is not None:
            c.env[n] = masked
        elif (root := _following_root(c, n)) is not None:
            c.env[n] = root
        else:
            c.node = n
            value = _translated(c, n)
            frontend_mask_bounds.follow(c, n)
            if value is not None:
                c.env[n] = value
    assert logits is not None and logits_node is not None
    if ids_node is not None:
        _with_vocabulary(c, ids_node)
    shape = tuple(c.shape(logits_node))
    samples, axis = int(example.shape[0]), c.batch_axis(logits)
    if len(shape) < 2 or axis not in (0, None) or shape[0] % samples:
        raise UnsupportedOpError(
            f"the model output must be logits of shape [batch, classes] (or [batch, classes, "
            f"d1, ...] with a label per position, as F.cross_entropy reads them, or each "
            f"sample's positions merged into the rows: logits.view(B * T, V)), got "
            f"{list(shape)} for a batch of {samples}"
        )
    # the loss reads a row of classes per position from the model's own tensor: where each
    # sample's positions are merged into its first axis, that axis is already sample-major
    read, read_shape = logits, shape
    if shape[0] != samples:
        c.loc = _user_location(logits_node)
        logits, shape = _rows_per_sample(c, logits_node, logits, shape, samples)
    batch, classes, positions = shape[0], shape[1], shape[2:]
    if classes >= MAX_CLASSES:
        raise UnsupportedOpError(
            f"the model's output has {classes} classes; mexc's integer loss head takes fewer "
            f"than {MAX_CLASSES} (its exp values of 2^15 each sum in int32: docs/layers.md, "
            "'Output head')"
        )
    rows, head_in = batch, read
    if positions:  # torch's K-dimensional cross-entropy: a row of classes per position
        rows = batch * int(np.prod(positions))
    if len(read_shape) > 2:  # the classes moved last, the rest flattened into rows
        last = (0, *range(2, len(read_shape)), 1)
        c.loc = _user_location(logits_node)
        moved = transposed(c, read, read_shape, last)
        head_in = reshaped(c, moved, (rows, classes))
    label = b.add(
        Op.LABEL, (), TensorType(Kind.I64, (rows,)), attrs(Op.LABEL, name="y", num_classes=classes)
    )
    head = b.add(
        Op.SOFTMAX_CE,
        (head_in, label.out),
        (f32(rows, classes), f32()),
        attrs(Op.SOFTMAX_CE, num_classes=classes),
    )
    _drop_dead_nodes(c, [logits, head.result(0), head.result(1)])
    held = tuple(a.text(name) for name, a in sorted(c.arranged.items()) if name in c.params)
    per_position = [(LABEL_SHAPE, tuple(positions))] if positions else []
    frozen = tuple(sorted(set(c.gm.meta.get(EVAL_NORM_WEIGHTS, ())) & set(c.params)))
    graph = b.build(
        [("logits", logits), ("probs", head.result(0)), ("loss", head.result(1))],
        [("batch", batch), ("num_classes", classes)]
        + per_position
        + ([(ARRANGED, held)] if held else [])
        + ([(EVAL_NORM_WEIGHTS, frozen)] if frozen else []),
    )
    shape = tuple(example.shape[1:])
    return FrontendResult(graph, c.params, c.buffers, shape, classes, frozenset(c.constants))
