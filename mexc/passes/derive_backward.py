"""derive-backward: append the backward graph, one VJP rule per op and one generic walker.

Requires: MX-typed graph with shift caps (after assign-shift-caps), a SOFTMAX_CE loss head.
Ensures: the graph computes the gradient of the loss w.r.t. every parameter. Backward nodes follow
  the forward nodes; a value read by several consumers gets a GRAD_SUM of its gradients. Parameter
  gradients are int32 accumulators (acc<i32>) exposed as outputs "grad:<param name>", to be consumed
  by insert-optimizer. Values that depend on no parameter (the quantized input) get no gradient.
  Backward products carry their shift caps and every rounding backward op a fresh rid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, GraphBuilder, Node, Op, Value
from mexc.ops import SCHEMA, attrs
from mexc.pass_manager import PassContext
from mexc.passes.assign_shift_caps import cap_for
from mexc.types import Kind, TensorType, acc, mx

Grads = list[Value | None]


@dataclass
class _Walker:
    g: Graph
    bits: int
    b: GraphBuilder
    next_rid: int
    needs: dict[Value, bool] = field(default_factory=dict)
    users: dict[Value, list[Node]] = field(default_factory=dict)
    types: dict[Value, TensorType] = field(default_factory=dict)
    param_grads: dict[str, Value] = field(default_factory=dict)
    masked_relus: set[int] = field(default_factory=set)  # relus whose mask a max pool applied

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
        return node

    def param_name(self, v: Value) -> str | None:
        n = self.g.node(v.node)
        return str(n.attrs.name) if n.op is Op.PARAM else None

    def set_param_grad(self, param: Value, grad: Value, at: Node) -> None:
        name = self.param_name(param)
        if name is None:
            return
        if name in self.param_grads:
            raise UnsupportedOpError(
                f"parameter '{name}' is used by more than one op (again by %{at.id} "
                f"{at.op.value}{', ' + at.loc if at.loc else ''}); shared weights are not supported"
            )
        self.param_grads[name] = grad


Rule = Callable[[_Walker, Node, Grads], Grads]


def _conv(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, wt = n.inputs[0], n.inputs[1]
    conv = {"stride": n.attrs.stride, "padding": n.attrs.padding, "groups": n.attrs.groups}
    dw = w.emit(Op.CONV2D_GRAD_WEIGHT, [dy, x], acc(*w.type(wt).shape), n.loc, **conv)
    w.set_param_grad(wt, dw.out, n)
    grads: Grads = [None, None]
    if w.needs[x]:
        grads[0] = w.emit(Op.CONV2D_GRAD_INPUT, [dy, wt], mx(*w.type(x).shape), n.loc, **conv).out
    if n.attrs.has_bias:
        db = w.emit(Op.BIAS_GRAD, [dy], acc(*w.type(n.inputs[2]).shape), n.loc, axes=(0, 2, 3))
        w.set_param_grad(n.inputs[2], db.out, n)
        grads.append(None)
    return grads


def _linear(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, wt = n.inputs[0], n.inputs[1]
    dw = w.emit(Op.LINEAR_GRAD_WEIGHT, [dy, x], acc(*w.type(wt).shape), n.loc)
    w.set_param_grad(wt, dw.out, n)
    grads: Grads = [None, None]
    if w.needs[x]:
        grads[0] = w.emit(Op.LINEAR_GRAD_INPUT, [dy, wt], mx(*w.type(x).shape), n.loc).out
    if n.attrs.has_bias:
        axes = tuple(range(len(w.type(dy).shape) - 1))  # tokens too for [B, T, D] input
        db = w.emit(Op.BIAS_GRAD, [dy], acc(*w.type(n.inputs[2]).shape), n.loc, axes=axes)
        w.set_param_grad(n.inputs[2], db.out, n)
        grads.append(None)
    return grads


def _compact(w: _Walker, n: Node, dys: Grads) -> Grads:
    return [dys[0]]


def _batchnorm(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, gamma, beta = n.inputs[0], n.inputs[1], n.inputs[2]
    c = w.type(gamma).shape
    node = w.emit(
        Op.BATCHNORM_GRAD,
        [dy, n.result(1), n.result(2), gamma],
        (mx(*w.type(x).shape), acc(*c), acc(*c)),
        n.loc,
    )
    w.set_param_grad(gamma, node.result(1), n)
    w.set_param_grad(beta, node.result(2), n)
    return [node.result(0) if w.needs[x] else None, None, None, None, None]


def _no_saved(n: Node) -> Value:
    return Value(-1)


def _pointwise(op: Op, saved: Callable[[Node], Value]) -> Rule:
    def rule(w: _Walker, n: Node, dys: Grads) -> Grads:
        dy = dys[0]
        assert dy is not None
        if not w.needs[n.inputs[0]]:
            return [None]
        a = {k: getattr(n.attrs, k) for k in SCHEMA[op] if k != "rid" and hasattr(n.attrs, k)}
        ins = [dy] if saved is _no_saved else [dy, saved(n)]
        return [w.emit(op, ins, mx(*w.type(n.inputs[0]).shape), n.loc, **a).out]

    return rule


def _relu_before_pool(w: _Walker, pool: Node) -> Node | None:
    """The ReLU feeding a non-overlapping, unpadded max pool as its only consumer, if any."""
    a = pool.attrs
    src = w.g.node(pool.inputs[0].node)
    overlapping = a.stride[0] < a.kernel[0] or a.stride[1] < a.kernel[1]
    if src.op is not Op.RELU or overlapping or tuple(a.padding) != (0, 0):
        return None
    return src if len(w.users.get(src.out, [])) == 1 else None


def _maxpool(w: _Walker, n: Node, dys: Grads) -> Grads:
    """Max-pool gradient. After a ReLU the mask is applied at the pooled positions: the pooled
    value is the ReLU output at the argmax, so the result is identical, and the full-size ReLU
    output need not be kept for the backward pass (paper-style memory saving)."""
    dy = dys[0]
    assert dy is not None
    x = n.inputs[0]
    if not w.needs[x]:
        return [None]
    relu = _relu_before_pool(w, n)
    if relu is not None:
        dy = w.emit(Op.RELU_GRAD, [dy, n.out], mx(*w.type(n.out).shape), relu.loc).out
        w.masked_relus.add(relu.id)
    a = n.attrs
    grad = w.emit(
        Op.MAXPOOL2D_GRAD,
        [dy, n.result(1)],
        mx(*w.type(x).shape),
        n.loc,
        kernel=a.kernel,
        stride=a.stride,
        padding=a.padding,
    )
    return [grad.out]


def _relu(w: _Walker, n: Node, dys: Grads) -> Grads:
    if n.id in w.masked_relus:
        return [dys[0]]  # the max pool after it already applied the mask
    return _pointwise(Op.RELU_GRAD, lambda m: m.out)(w, n, dys)


def _add(w: _Walker, n: Node, dys: Grads) -> Grads:
    return [dys[0] if w.needs[v] else None for v in n.inputs]


def _reshape(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x = n.inputs[0]
    if not w.needs[x]:
        return [None]
    shape = w.type(x).shape
    return [w.emit(Op.RESHAPE, [dy], mx(*shape), n.loc, shape=shape).out]


def _softmax_ce(w: _Walker, n: Node, dys: Grads) -> Grads:
    logits = n.inputs[0]
    grad = w.emit(Op.SOFTMAX_CE_GRAD, [n.result(0), n.inputs[1]], mx(*w.type(logits).shape), n.loc)
    return [grad.out, None]


def _layernorm(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, gamma, beta = n.inputs
    d = w.type(gamma).shape
    node = w.emit(
        Op.LAYERNORM_GRAD, [dy, n.result(1), gamma], (mx(*w.type(x).shape), acc(*d), acc(*d)), n.loc
    )
    w.set_param_grad(gamma, node.result(1), n)
    w.set_param_grad(beta, node.result(2), n)
    return [node.result(0) if w.needs[x] else None, None, None]


def _matmul(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    a, b = n.inputs
    node = w.emit(Op.MATMUL_GRAD, [dy, a, b], (mx(*w.type(a).shape), mx(*w.type(b).shape)), n.loc)
    return [node.result(0) if w.needs[a] else None, node.result(1) if w.needs[b] else None]


def _transpose(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    perm = tuple(n.attrs.perm)
    inverse = tuple(perm.index(i) for i in range(len(perm)))
    return [w.emit(Op.TRANSPOSE, [dy], mx(*w.type(n.inputs[0]).shape), n.loc, perm=inverse).out]


def _add_param(w: _Walker, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, p = n.inputs
    dp = w.emit(Op.ADD_PARAM_GRAD, [dy], acc(*w.type(p).shape), n.loc)
    w.set_param_grad(p, dp.out, n)
    return [dy if w.needs[x] else None, None]


RULES: dict[Op, Rule] = {
    Op.CONV2D_COMPACT: _conv,
    Op.CONV2D: _conv,
    Op.LINEAR_COMPACT: _linear,
    Op.LINEAR: _linear,
    Op.COMPACT: _compact,
    Op.BATCHNORM: _batchnorm,
    Op.RELU: _relu,
    Op.RELU6: _pointwise(Op.RELU6_GRAD, lambda n: n.out),
    Op.MAXPOOL2D: _maxpool,
    Op.AVGPOOL2D: _pointwise(Op.AVGPOOL2D_GRAD, _no_saved),
    Op.GLOBAL_AVGPOOL: _pointwise(Op.GLOBAL_AVGPOOL_GRAD, _no_saved),
    Op.DROPOUT: _pointwise(Op.DROPOUT_GRAD, lambda n: n.result(1)),
    Op.ADD: _add,
    Op.RESHAPE: _reshape,
    Op.SOFTMAX_CE: _softmax_ce,
    Op.LAYERNORM: _layernorm,
    Op.GELU: _pointwise(Op.GELU_GRAD, lambda n: n.inputs[0]),
    Op.SOFTMAX: _pointwise(Op.SOFTMAX_GRAD, lambda n: n.out),
    Op.MATMUL: _matmul,
    Op.SCALE: _pointwise(Op.SCALE_GRAD, _no_saved),
    Op.TRANSPOSE: _transpose,
    Op.SLICE: _pointwise(Op.SLICE_GRAD, _no_saved),
    Op.ADD_PARAM: _add_param,
    Op.MEAN_TOKENS: _pointwise(Op.MEAN_TOKENS_GRAD, _no_saved),
}
NO_GRAD = frozenset({Op.INPUT, Op.LABEL, Op.PARAM, Op.STATE, Op.QUANTIZE})


def _needs_grad(g: Graph) -> dict[Value, bool]:
    """A value needs a gradient when it is a parameter or computed from one."""
    needs: dict[Value, bool] = {}
    for n in g.nodes:
        flag = n.op is Op.PARAM or (n.op not in NO_GRAD and any(needs[v] for v in n.inputs))
        for i in range(len(n.types)):
            needs[n.result(i)] = flag
    return needs


def _max_rid(g: Graph) -> int:
    return max((int(n.attrs.rid) for n in g.nodes if "rid" in SCHEMA[n.op]), default=-1)


def derive_backward(g: Graph, ctx: PassContext) -> Graph:
    """Walk the forward graph backwards from the loss, applying RULES."""
    heads = g.nodes_of(Op.SOFTMAX_CE)
    if len(heads) != 1:
        raise UnsupportedOpError("the training graph needs exactly one softmax cross-entropy head")
    b = GraphBuilder(g.next_id())
    for n in g.nodes:
        b.keep(n)
    w = _Walker(g, int(g.attr("bits", ctx.bits)), b, _max_rid(g) + 1, _needs_grad(g))
    w.users = g.users()
    for n in g.nodes:
        for i, t in enumerate(n.types):
            w.types[n.result(i)] = t
    pending: dict[Value, list[Value]] = {}
    for n in reversed(g.nodes):
        if n.op in NO_GRAD:
            continue
        rule = RULES.get(n.op)
        if rule is None:
            raise UnsupportedOpError(f"no VJP rule for op {n.op.value} (node %{n.id})")
        dys: Grads = [_collect(w, pending, n.result(i), n.loc) for i in range(len(n.types))]
        if n.op is not Op.SOFTMAX_CE and dys[0] is None:
            continue
        for v, grad in zip(n.inputs, rule(w, n, dys)):
            if grad is not None:
                pending.setdefault(v, []).append(grad)
    outputs = list(g.outputs) + [(f"grad:{k}", v) for k, v in sorted(w.param_grads.items())]
    return b.build(outputs, g.attrs)


def _collect(w: _Walker, pending: dict[Value, list[Value]], v: Value, loc: str) -> Value | None:
    grads = pending.pop(v, [])
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    t = w.type(grads[0])
    return w.emit(Op.GRAD_SUM, grads, TensorType(Kind.MX, t.shape, t.exp), loc).out
