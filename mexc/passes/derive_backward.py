"""derive-backward: append the backward graph, one VJP rule per op (OpDef.vjp, mexc.ops) and one
generic walker.

Requires: MX-typed graph with shift caps (after assign-shift-caps), a SOFTMAX_CE loss head.
Ensures: the graph computes the gradient of the loss w.r.t. every trained parameter (all, or
  ctx.trainable: a frozen one gets no gradient, and no backward node that only its gradient
  needed is built: mexc.trainable). Backward nodes follow
  the forward nodes; a value read by several consumers gets a GRAD_SUM of its gradients. Parameter
  gradients are int32 accumulators (acc<i32>) exposed as outputs "grad:<param name>", to be consumed
  by insert-optimizer. Values that depend on no parameter (the quantized input) get no gradient.
  Backward products carry their shift caps and every rounding backward op a fresh rid. The graph
  attribute `forward_rids` records how many rids the forward graph used (Graph.is_forward): the
  rounding mode nearest-forward rounds those nodes to nearest (docs/numerics.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, GraphBuilder, Node, Op, Value, needed_nodes
from mexc.kernels.elementwise import MAX_SUM_TERMS
from mexc.ops import SCHEMA, attrs, op_def
from mexc.pass_manager import PassContext
from mexc.passes.assign_shift_caps import cap_for, operand_bits
from mexc.types import Kind, TensorType, mx

Grads = list[Value | None]


@dataclass
class _Walker:
    """The state each op's VJP rule works on."""

    g: Graph
    bits: int
    b: GraphBuilder
    next_rid: int
    needs: dict[Value, bool] = field(default_factory=dict)
    users: dict[Value, list[Node]] = field(default_factory=dict)
    types: dict[Value, TensorType] = field(default_factory=dict)
    # per parameter, the sum of its readers' gradients so far
    param_grads: dict[str, Value] = field(default_factory=dict)
    masked_relus: set[int] = field(default_factory=set)  # relus whose mask a max pool applied
    slice_grads: dict[Value, Node] = field(default_factory=dict)  # slice gradients emitted
    dropped: set[int] = field(default_factory=set)  # slice gradients a concat joined
    batch_axes: dict[Value, int | None] = field(default_factory=dict)  # forward values'

    def type(self, v: Value) -> TensorType:
        return self.types[v]

    def emit(
        self,
        op: Op,
        inputs: list[Value],
        types: TensorType | tuple[TensorType, ...],
        loc: str = "",
        **kw: object,
    ) -> Node:
        if "rid" in SCHEMA[op]:
            kw["rid"] = self.next_rid
            self.next_rid += 1
        tys = types if isinstance(types, tuple) else (types,)
        node = self.b.add(op, inputs, tys, attrs(op, **kw), loc)
        if "shift_cap" in SCHEMA[op]:
            node = cap_for(node, lambda i: self.types[inputs[i]], self.bits)
            self.b.nodes[-1] = node
        for i, t in enumerate(tys):
            self.types[node.result(i)] = t
        if op is Op.SLICE_GRAD:
            self.slice_grads[node.out] = node
        return node

    def param_name(self, v: Value) -> str | None:
        n = self.g.node(v.node)
        return str(n.attrs.name) if n.op is Op.PARAM else None

    def set_param_grad(self, param: Value, grad: Value, at: Node) -> None:
        """One reader's gradient of a parameter; a parameter read by several ops (shared
        weights) gets their sum (docs/numerics.md §7c): each reader's accumulator added to the
        sum so far as soon as it exists, so that a weight a loop reads T times holds two
        accumulators at a time, not T (a sum is exact unless its terms span more than 29
        bits)."""
        name = self.param_name(param)
        if name is None:
            return
        total = self.param_grads.get(name)
        if total is not None:
            grad = self.emit(Op.PARAM_GRAD_SUM, [total, grad], self.type(grad), at.loc).out
        self.param_grads[name] = grad

    def weight_grad(self, weight: Value, grad: Value, at: Node) -> Value | None:
        """The int32 gradient `grad` of an op's weight: a parameter's is its (set_param_grad,
        None returned); a weight computed from parameters (a standardized convolution's, a
        norm's gain times a number) gets it compacted per tensor (COMPACT alone), which the
        VJP returns as the weight's gradient for the ops that computed it."""
        if self.param_name(weight) is not None:
            self.set_param_grad(weight, grad, at)
            return None
        if not self.needs[weight]:
            return None
        bits = int(self.g.attr("bits", 8))
        shape = self.type(weight).shape
        return self.emit(Op.COMPACT, [grad], mx(*shape), at.loc, bits=bits).out


def _no_grad(n: Node) -> bool:
    d = op_def(n.op)
    return d.boundary or d.no_grad


def _needs_grad(g: Graph, trainable: frozenset[str] | None) -> dict[Value, bool]:
    """A value needs a gradient when it is a trained parameter or computed from one."""
    needs: dict[Value, bool] = {}
    for n in g.nodes:
        trained = n.op is Op.PARAM and (trainable is None or str(n.attrs.name) in trainable)
        flag = trained or (not _no_grad(n) and any(needs[v] for v in n.inputs))
        for i in range(len(n.types)):
            needs[n.result(i)] = flag
    return needs


def _max_rid(g: Graph) -> int:
    return max((int(n.attrs.rid) for n in g.nodes if "rid" in SCHEMA[n.op]), default=-1)


def derive_backward(g: Graph, ctx: PassContext) -> Graph:
    """Walk the forward graph backwards from the loss, applying each op's VJP rule."""
    heads = [n for n in g.nodes if op_def(n.op).loss_head]
    if len(heads) != 1:
        raise UnsupportedOpError("the training graph needs exactly one softmax cross-entropy head")
    b = GraphBuilder(g.next_id())
    for n in g.nodes:
        b.keep(n)
    needs = _needs_grad(g, ctx.trainable)
    w = _Walker(g, operand_bits(g, int(g.attr("bits", ctx.bits))), b, _max_rid(g) + 1, needs)
    w.users = g.users()
    for n in g.nodes:
        known = [(w.types[u], a) for u in n.inputs if (a := w.batch_axes.get(u)) is not None]
        axis = op_def(n.op).batch_axis(n, known)
        for i, t in enumerate(n.types):
            w.types[n.result(i)] = t
            w.batch_axes[n.result(i)] = axis
    pending: dict[Value, list[Value]] = {}
    for n in reversed(g.nodes):
        if _no_grad(n):
            continue
        d = op_def(n.op)
        if d.vjp is None:
            raise UnsupportedOpError(f"no VJP rule for op {n.op.value} (node %{n.id})")
        dys: Grads = [_collect(w, pending, n.result(i), n.loc) for i in range(len(n.types))]
        if not d.loss_head and dys[0] is None:
            continue
        for v, grad in zip(n.inputs, d.vjp(w, n, dys)):
            if grad is not None:
                pending.setdefault(v, []).append(grad)
    trained = {
        k: v for k, v in w.param_grads.items() if ctx.trainable is None or k in ctx.trainable
    }
    outputs = list(g.outputs) + [(f"grad:{k}", v) for k, v in sorted(trained.items())]
    attrs = g.with_attrs(forward_rids=_max_rid(g) + 1)
    if ctx.trainable is not None:
        frozen = len(g.nodes_of(Op.PARAM)) - len(trained)
        attrs = attrs.with_attrs(frozen_params=frozen)
    # the slice gradients a concat replaced, unless another gradient reads them too (an add
    # passes one gradient to both its inputs)
    read = {v for n in b.nodes for v in n.inputs} | {v for _, v in outputs}
    b.nodes = [n for n in b.nodes if n.id not in w.dropped or n.out in read]
    out = b.build(outputs, attrs.attrs)
    return out if ctx.trainable is None else _prune_backward(out, g.next_id())


def _prune_backward(g: Graph, first_backward: int) -> Graph:
    """`g` without the backward nodes (ids from `first_backward`) that no output needs: a frozen
    parameter's weight gradient, and what only it read."""
    keep = {n.id for n in needed_nodes(g, [name for name, _ in g.outputs])}
    nodes = [n for n in g.nodes if n.id < first_backward or n.id in keep]
    return Graph(tuple(nodes), g.outputs, g.attrs)


def _collect(w: _Walker, pending: dict[Value, list[Value]], v: Value, loc: str) -> Value | None:
    grads = pending.pop(v, [])
    if not grads:
        return None
    if len(grads) > 1:
        grads = _joined_slices(w, v, grads, loc)
    if len(grads) == 1:
        return grads[0]
    t = w.type(grads[0])
    return _summed(w, Op.GRAD_SUM, grads, TensorType(Kind.MX, t.shape, t.exp), loc)


def _bounds(n: Node) -> tuple[int, int]:
    return int(n.attrs.start), int(n.attrs.stop)


def _joined_slices(w: _Walker, v: Value, grads: list[Value], loc: str) -> list[Value]:
    """The gradients of v read by slices along one axis other than its batch axis (the first
    where mexc lost it): an LSTM's steps of its input projection, a chunk's pieces, attention's
    q, k and v unbound from one projection. The gradients of adjacent, disjoint
    slices concatenated into one (`concat`: one alignment and compaction), placed into zeros
    (`slice_grad`) where they do not cover the axis. Summing each slice's gradient, a whole
    tensor of zeros around it, kept T tensors of the value's size live for T slices
    (docs/layers.md, "Gradient sums"). Joined runs come first, in order along the axis, then
    the other gradients in the order they were differentiated."""
    rank = len(w.type(grads[0]).shape)
    batch = w.batch_axes.get(v)
    batch = 0 if batch is None else batch
    by_dim: dict[int, list[Node]] = {}
    for u in grads:
        n = w.slice_grads.get(u)
        if n is not None and int(n.attrs.dim) % rank != batch:
            by_dim.setdefault(int(n.attrs.dim) % rank, []).append(n)
    if not by_dim:
        return grads
    dim, pieces = max(by_dim.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    runs: list[list[Node]] = []
    for n in sorted(pieces, key=_bounds):
        start = _bounds(n)[0]
        if runs and start == _bounds(runs[-1][-1])[1]:
            runs[-1].append(n)
        elif not runs or start >= _bounds(runs[-1][-1])[1]:  # an overlapping slice: summed
            runs.append([n])
    joined: list[Value] = []
    rest = list(grads)  # one occurrence per joined slice: `a + a` lists one gradient twice
    for run in (r for r in runs if len(r) > 1):
        full = w.type(grads[0]).shape
        start, stop = _bounds(run[0])[0], _bounds(run[-1])[1]
        part = tuple(stop - start if i == dim else d for i, d in enumerate(full))
        total = w.emit(Op.CONCAT, [n.inputs[0] for n in run], mx(*part), loc, dim=dim).out
        if part != full:
            total = w.emit(
                Op.SLICE_GRAD, [total], mx(*full), loc, dim=dim, start=start, stop=stop
            ).out
        joined.append(total)
        w.dropped.update(n.id for n in run)
        for n in run:
            rest.remove(n.out)
    return joined + rest


def _summed(w: _Walker, op: Op, grads: list[Value], typ: TensorType, loc: str) -> Value:
    """The sum of `grads` by `op` (GRAD_SUM, PARAM_GRAD_SUM; one term: itself). A sum has
    rounding sites for at most MAX_SUM_TERMS terms (docs/layers.md): more (a DenseNet feature,
    read by every later layer's concat; a block applied in a long loop) sum in a tree."""
    while len(grads) > 1:
        grads = [
            w.emit(op, part, typ, loc).out if len(part) > 1 else part[0]
            for part in (grads[i : i + MAX_SUM_TERMS] for i in range(0, len(grads), MAX_SUM_TERMS))
        ]
    return grads[0]
