"""insert-mx-types: give every value a mantissa-exponent type.

Requires: a float graph from the frontend (f32 values, PARAM/STATE/INPUT/LABEL boundary nodes).
Ensures: the input is quantized once by a QUANTIZE node; every other value is integer:
  parameters and activations are mx<i8,e=tensor>, products (conv2d, linear) yield acc<i32>
  followed by an explicit COMPACT node, probabilities are u8, max-pool indices and dropout masks
  are idx. The only f32 values left are the input (consumed by QUANTIZE) and the logging-only
  loss. Every op that rounds gets a distinct rounding-site id `rid`.
"""

from __future__ import annotations

from collections.abc import Callable

from mexc.ir import Graph, GraphBuilder, Node, Op, Value
from mexc.ops import SCHEMA, attrs, with_attrs
from mexc.pass_manager import PassContext
from mexc.types import Exp, Kind, TensorType, acc, mx


def _mx_like(t: TensorType) -> TensorType:
    return mx(*t.shape)


class _Rewriter:
    def __init__(self, g: Graph, ctx: PassContext) -> None:
        self.g, self.ctx = g, ctx
        self.b = GraphBuilder()
        self.env: dict[Value, Value] = {}
        self.next_rid = 0

    def rid(self) -> int:
        self.next_rid += 1
        return self.next_rid - 1

    def ins(self, n: Node) -> list[Value]:
        return [self.env[v] for v in n.inputs]

    def copy(self, n: Node, types: tuple[TensorType, ...], **attr_changes: object) -> Node:
        a = with_attrs(n.op, n.attrs, **attr_changes) if attr_changes else n.attrs
        if "rid" in SCHEMA[n.op] and a.rid < 0:
            a = with_attrs(n.op, a, rid=self.rid())
        new = self.b.add(n.op, self.ins(n), types, a, n.loc)
        for i in range(len(n.types)):
            self.env[n.result(i)] = new.result(i)
        return new


def _boundary(r: _Rewriter, n: Node) -> None:
    if n.op is Op.INPUT:
        raw = r.b.add(Op.INPUT, (), n.types, n.attrs, n.loc)
        q = r.b.add(
            Op.QUANTIZE, [raw.out], _mx_like(n.type), attrs(Op.QUANTIZE, bits=r.ctx.bits), n.loc
        )
        r.env[n.out] = q.out
    elif n.op is Op.LABEL:
        r.copy(n, n.types)
    elif n.op is Op.STATE and n.attrs.role in ("running_mean", "running_var"):
        # one exponent per channel: channel variances differ by orders of magnitude
        r.copy(n, (mx(*n.type.shape, exp=Exp.AXIS0),))
    else:  # PARAM / STATE
        r.copy(n, (_mx_like(n.type),))


def _product(r: _Rewriter, n: Node) -> None:
    prod = r.copy(n, (acc(*n.type.shape),))
    compact = r.b.add(
        Op.COMPACT,
        [prod.out],
        _mx_like(n.type),
        attrs(Op.COMPACT, bits=r.ctx.bits, rid=r.rid()),
        n.loc,
    )
    r.env[n.out] = compact.out


def _elementwise(r: _Rewriter, n: Node) -> None:
    r.copy(n, (_mx_like(n.type),))


def _maxpool(r: _Rewriter, n: Node) -> None:
    new = r.copy(n, (_mx_like(n.type), TensorType(Kind.IDX, n.type.shape)))
    r.env[n.out] = new.out


def _dropout(r: _Rewriter, n: Node) -> None:
    new = r.copy(n, (_mx_like(n.type), TensorType(Kind.IDX, n.type.shape)))
    r.env[n.out] = new.out


def _batchnorm(r: _Rewriter, n: Node) -> None:
    c = n.type.shape[1]
    # results: y, saved normalized input (xhat), batch statistics (mean, var) per channel
    stats = TensorType(Kind.ACC, (2, c), Exp.AXIS0)
    new = r.copy(n, (_mx_like(n.type), _mx_like(n.type), stats))
    r.env[n.out] = new.out


def _softmax_ce(r: _Rewriter, n: Node) -> None:
    probs = TensorType(Kind.U8, n.types[0].shape)
    r.copy(n, (probs, n.types[1]))


def _layernorm(r: _Rewriter, n: Node) -> None:
    # results: y and the saved normalized input (xhat) for the backward pass
    new = r.copy(n, (_mx_like(n.type), _mx_like(n.type)))
    r.env[n.out] = new.out


RULES: dict[Op, Callable[[_Rewriter, Node], None]] = {
    Op.INPUT: _boundary,
    Op.LABEL: _boundary,
    Op.PARAM: _boundary,
    Op.STATE: _boundary,
    Op.CONV2D: _product,
    Op.LINEAR: _product,
    Op.BATCHNORM: _batchnorm,
    Op.RELU: _elementwise,
    Op.RELU6: _elementwise,
    Op.MAXPOOL2D: _maxpool,
    Op.AVGPOOL2D: _elementwise,
    Op.GLOBAL_AVGPOOL: _elementwise,
    Op.ADD: _elementwise,
    Op.RESHAPE: _elementwise,
    Op.DROPOUT: _dropout,
    Op.SOFTMAX_CE: _softmax_ce,
    Op.LAYERNORM: _layernorm,
    Op.GELU: _elementwise,
    Op.SOFTMAX: _elementwise,
    Op.MATMUL: _elementwise,  # product and compaction in one kernel
    Op.SCALE: _elementwise,
    Op.TRANSPOSE: _elementwise,
    Op.SLICE: _elementwise,
    Op.ADD_PARAM: _elementwise,
    Op.MEAN_TOKENS: _elementwise,
}


def insert_mx_types(g: Graph, ctx: PassContext) -> Graph:
    """Quantize at the boundary, type every value as MX / acc / u8 / idx, assign rounding sites."""
    r = _Rewriter(g, ctx)
    for n in g.nodes:
        rule = RULES.get(n.op)
        if rule is None:
            raise ValueError(f"insert-mx-types has no rule for op {n.op.value}")
        rule(r, n)
    outputs = [(name, r.env[v]) for name, v in g.outputs]
    return r.b.build(outputs, g.with_attrs(bits=ctx.bits).attrs)
