"""mexc IR: a small typed SSA graph of immutable nodes.

A `Graph` holds nodes in execution order. A node has an `Op`, input references (`Value`: node id
and result index), one or more result types and a frozen per-op attribute dataclass (see
`mexc.ops`). Inputs, labels, parameters and optimizer state are nodes too (ops INPUT, LABEL, PARAM,
STATE) so a graph is self-contained; named outputs say what the program returns and which state it
writes back.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from mexc.types import TensorType

# graph attribute: the labels' shape per sample where the model's logits are [batch, classes,
# d1, ...] (a label per position, as F.cross_entropy reads them); absent: one label per sample
LABEL_SHAPE = "label_shape"
# graph attribute: the weights of batch norms a training model keeps in eval mode, written out
# as products (mexc.frontend_eval_modes): norm weights all the same (trainable="bias-norm")
EVAL_NORM_WEIGHTS = "eval_norm_weights"


class Op(enum.Enum):
    # graph boundary
    INPUT = "input"
    LABEL = "label"
    PARAM = "param"
    STATE = "state"
    QUANTIZE = "quantize"
    # forward layers
    CONV2D = "conv2d"
    LINEAR = "linear"
    COMPACT = "compact"
    CONV2D_COMPACT = "conv2d_compact"
    LINEAR_COMPACT = "linear_compact"
    BATCHNORM = "batchnorm"
    RELU = "relu"
    RELU6 = "relu6"
    CLAMP = "clamp"
    LEAKY_RELU = "leaky_relu"
    HARDSWISH = "hardswish"
    HARDSIGMOID = "hardsigmoid"
    SIGMOID = "sigmoid"
    SILU = "silu"
    TANH = "tanh"
    MISH = "mish"
    ACTIVATION_OFFSET = "activation_offset"
    MAXPOOL2D = "maxpool2d"
    UPSAMPLE_NEAREST = "upsample_nearest"
    AVGPOOL2D = "avgpool2d"
    GLOBAL_AVGPOOL = "global_avgpool"
    ADD = "add"
    RESHAPE = "reshape"
    DROPOUT = "dropout"
    SOFTMAX_CE = "softmax_ce"
    # transformer layers
    LAYERNORM = "layernorm"
    GELU = "gelu"
    SOFTMAX = "softmax"
    MATMUL = "matmul"
    SCALE = "scale"
    TRANSPOSE = "transpose"
    SLICE = "slice"
    PAD = "pad"
    ADD_PARAM = "add_param"
    MEAN_TOKENS = "mean_tokens"
    CONCAT = "concat"
    MUL = "mul"
    DIV = "div"
    DETACH = "detach"
    EXPAND_PARAM = "expand_param"
    GATHER_PARAM = "gather_param"
    EMBEDDING = "embedding"
    # backward
    SOFTMAX_CE_GRAD = "softmax_ce_grad"
    CONV2D_GRAD_INPUT = "conv2d_grad_input"
    CONV2D_GRAD_WEIGHT = "conv2d_grad_weight"
    LINEAR_GRAD_INPUT = "linear_grad_input"
    LINEAR_GRAD_WEIGHT = "linear_grad_weight"
    BIAS_GRAD = "bias_grad"
    BATCHNORM_GRAD = "batchnorm_grad"
    BATCHNORM_AFFINE = "batchnorm_affine"
    RELU_GRAD = "relu_grad"
    RELU6_GRAD = "relu6_grad"
    CLAMP_GRAD = "clamp_grad"
    LEAKY_RELU_GRAD = "leaky_relu_grad"
    HARDSWISH_GRAD = "hardswish_grad"
    HARDSIGMOID_GRAD = "hardsigmoid_grad"
    SIGMOID_GRAD = "sigmoid_grad"
    SILU_GRAD = "silu_grad"
    TANH_GRAD = "tanh_grad"
    MISH_GRAD = "mish_grad"
    ACTIVATION_OFFSET_GRAD = "activation_offset_grad"
    MAXPOOL2D_GRAD = "maxpool2d_grad"
    UPSAMPLE_NEAREST_GRAD = "upsample_nearest_grad"
    AVGPOOL2D_GRAD = "avgpool2d_grad"
    GLOBAL_AVGPOOL_GRAD = "global_avgpool_grad"
    DROPOUT_GRAD = "dropout_grad"
    GRAD_SUM = "grad_sum"
    PARAM_GRAD_SUM = "param_grad_sum"
    LAYERNORM_GRAD = "layernorm_grad"
    GELU_GRAD = "gelu_grad"
    SOFTMAX_GRAD = "softmax_grad"
    MATMUL_GRAD = "matmul_grad"
    SCALE_GRAD = "scale_grad"
    SLICE_GRAD = "slice_grad"
    ADD_PARAM_GRAD = "add_param_grad"
    GATHER_PARAM_GRAD = "gather_param_grad"
    EMBEDDING_GRAD = "embedding_grad"
    MEAN_TOKENS_GRAD = "mean_tokens_grad"
    MUL_GRAD = "mul_grad"
    # data parallel
    ALL_REDUCE = "all_reduce"
    # optimizer
    SGD_UPDATE = "sgd_update"
    ADAMW_UPDATE = "adamw_update"
    BN_RUNNING_UPDATE = "bn_running_update"


@dataclass(frozen=True, order=True)
class Value:
    """A reference to result `index` of node `node`."""

    node: int
    index: int = 0

    def __str__(self) -> str:
        return f"%{self.node}" if self.index == 0 else f"%{self.node}#{self.index}"


@dataclass(frozen=True)
class Node:
    id: int
    op: Op
    inputs: tuple[Value, ...]
    types: tuple[TensorType, ...]
    attrs: Any  # a frozen dataclass from mexc.ops.ATTRS[op]
    loc: str = ""  # user source location, "file.py:LINE", for error messages

    @property
    def type(self) -> TensorType:
        """The type of the first (usually only) result."""
        return self.types[0]

    @property
    def out(self) -> Value:
        return Value(self.id, 0)

    def result(self, index: int) -> Value:
        return Value(self.id, index)

    def with_(self, **changes: Any) -> Node:
        return replace(self, **changes)


def in_forward(n: Node, forward_rids: int) -> bool:
    """Whether `n` rounds as a node of the forward graph: its rounding-site id is below the graph's
    `forward_rids` (Graph.is_forward). Nodes without a rid do not round."""
    rid = getattr(n.attrs, "rid", -1)
    return 0 <= int(rid) < forward_rids


@dataclass(frozen=True)
class Graph:
    """Nodes in execution order plus named outputs. Immutable; passes build new graphs."""

    nodes: tuple[Node, ...]
    outputs: tuple[tuple[str, Value], ...]
    attrs: tuple[tuple[str, Any], ...] = field(default=())  # graph-level facts (bits, batch, ...)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, node_id: int) -> Node:
        return self.by_id()[node_id]

    def by_id(self) -> dict[int, Node]:
        return {n.id: n for n in self.nodes}

    def type_of(self, value: Value) -> TensorType:
        return self.node(value.node).types[value.index]

    def output(self, name: str) -> Value:
        for n, v in self.outputs:
            if n == name:
                return v
        raise KeyError(name)

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    @property
    def forward_rids(self) -> int:
        """How many rounding-site ids the forward graph used, as derive-backward records it in
        the attribute `forward_rids` (0 before it runs); the nodes of later passes (the backward
        pass, the updates) number theirs from there."""
        return int(self.attr("forward_rids", 0))

    def is_forward(self, n: Node) -> bool:
        """Whether `n` is a node of the forward graph (its rid is below `forward_rids`)."""
        return in_forward(n, self.forward_rids)

    def with_attrs(self, **updates: Any) -> Graph:
        merged = dict(self.attrs)
        merged.update(updates)
        return replace(self, attrs=tuple(sorted(merged.items())))

    def nodes_of(self, *ops: Op) -> list[Node]:
        return [n for n in self.nodes if n.op in ops]

    def users(self) -> dict[Value, list[Node]]:
        """For every value, the nodes that read it (in order)."""
        uses: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                uses.setdefault(v, []).append(n)
        return uses

    def next_id(self) -> int:
        return max((n.id for n in self.nodes), default=-1) + 1


def needed_nodes(g: Graph, outputs: list[str]) -> list[Node]:
    """The nodes (in order) that the named outputs depend on."""
    by_id = g.by_id()
    need: set[int] = set()
    stack = [g.output(name).node for name in outputs]
    while stack:
        nid = stack.pop()
        if nid in need:
            continue
        need.add(nid)
        stack.extend(v.node for v in by_id[nid].inputs)
    return [n for n in g.nodes if n.id in need]


def fed_by_input(nodes: Iterable[Node]) -> set[int]:
    """The ids of the nodes (in order) that depend on the model's input or labels; the others
    are computed from parameters and constants alone (a standardized weight)."""
    fed: set[int] = set()
    for n in nodes:
        if n.op in (Op.INPUT, Op.LABEL) or any(v.node in fed for v in n.inputs):
            fed.add(n.id)
    return fed


class GraphBuilder:
    """Appends nodes with fresh ids; used by the frontend and by passes that rebuild graphs."""

    def __init__(self, start_id: int = 0) -> None:
        self.nodes: list[Node] = []
        self._next = start_id

    def add(
        self,
        op: Op,
        inputs: Iterable[Value],
        types: TensorType | tuple[TensorType, ...],
        attrs: Any,
        loc: str = "",
    ) -> Node:
        tys = types if isinstance(types, tuple) else (types,)
        node = Node(self._next, op, tuple(inputs), tys, attrs, loc)
        self._next += 1
        self.nodes.append(node)
        return node

    def keep(self, node: Node) -> Node:
        """Append an existing node unchanged (its id must be unused)."""
        self.nodes.append(node)
        self._next = max(self._next, node.id + 1)
        return node

    def build(self, outputs: Iterable[tuple[str, Value]], attrs: Any = ()) -> Graph:
        return Graph(tuple(self.nodes), tuple(outputs), tuple(attrs))
