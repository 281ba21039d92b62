"""insert-mx-types: give every value a mantissa-exponent type.

Requires: a float graph from the frontend (f32 values, PARAM/STATE/INPUT/LABEL boundary nodes).
Ensures: the input is quantized once by a QUANTIZE node; every other value is integer:
  parameters and activations are mx<i8,e=tensor>, products (conv2d, linear) yield acc<i32>
  followed by an explicit COMPACT node, probabilities are i16, max-pool indices and dropout masks
  are idx. The only f32 values left are the input (consumed by QUANTIZE) and the logging-only
  loss. Every op that rounds gets a distinct rounding-site id `rid`. Each op's rule is its
  definition's `types` (mexc.ops). With ctx.channel_exponents below 8 bits the graph carries
  `channel_exponents` (docs/numerics.md §5: the same types, rounded per channel).
"""

from __future__ import annotations

from mexc.ir import Graph, GraphBuilder, Node, Value
from mexc.ops import SCHEMA, op_def, with_attrs
from mexc.pass_manager import PassContext
from mexc.types import TensorType


class _Rewriter:
    """The state each op's type rule (OpDef.types) works on."""

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


def insert_mx_types(g: Graph, ctx: PassContext) -> Graph:
    """Quantize at the boundary, type every value as MX / acc / i16 / idx, assign rounding sites."""
    r = _Rewriter(g, ctx)
    for n in g.nodes:
        rule = op_def(n.op).types
        if rule is None:
            raise ValueError(f"insert-mx-types has no rule for op {n.op.value}")
        rule(r, n)
    outputs = [(name, r.env[v]) for name, v in g.outputs]
    # channel exponents (numerics §5) change how results are rounded, not their types: every
    # mantissa stays int8 at one exponent per tensor; the graph says it for readers of the IR
    channels = {"channel_exponents": True} if ctx.channel_exponents and ctx.bits < 8 else {}
    return r.b.build(outputs, g.with_attrs(bits=ctx.bits, **channels).attrs)
