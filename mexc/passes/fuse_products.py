"""fuse-products: a product and the compaction of its int32 accumulator become one op.

Requires: MX-typed graph (after insert-mx-types).
Ensures: every product with a fused form (OpDef.fused: CONV2D, LINEAR) whose only user is a
  compaction is replaced by its fused op (CONV2D_COMPACT, LINEAR_COMPACT) carrying the
  compaction's bits and rounding site (so results are bit-identical to the unfused pair).
  Products with other users are left unfused.
"""

from __future__ import annotations

from mexc.ir import Graph, GraphBuilder, Value
from mexc.ops import SCHEMA, attr_items, attrs, op_def
from mexc.pass_manager import PassContext


def fuse_products(g: Graph, ctx: PassContext) -> Graph:
    """Fuse product + compaction pairs."""
    users = g.users()
    by_id = g.by_id()
    b = GraphBuilder(g.next_id())
    env: dict[Value, Value] = {}
    fused_into: dict[int, int] = {}  # compact node id -> product node id
    for n in g.nodes:
        if op_def(n.op).fused is not None:
            readers = users.get(n.out, [])
            if len(readers) == 1 and op_def(readers[0].op).compaction:
                fused_into[readers[0].id] = n.id
                continue
        if n.id in fused_into:
            prod = by_id[fused_into[n.id]]
            fields = dict(attr_items(prod.op, prod.attrs))
            fields.update(bits=n.attrs.bits, rid=n.attrs.rid)
            op = op_def(prod.op).fused
            assert op is not None
            kept = {k: v for k, v in fields.items() if k in SCHEMA[op]}
            new = b.keep(
                n.with_(
                    op=op,
                    inputs=tuple(env.get(v, v) for v in prod.inputs),
                    attrs=attrs(op, **kept),
                    loc=prod.loc,
                )
            )
            env[n.out] = new.out
            continue
        new = b.keep(n.with_(inputs=tuple(env.get(v, v) for v in n.inputs)))
        for i in range(len(n.types)):
            env[n.result(i)] = new.result(i)
    outputs = [(name, env.get(v, v)) for name, v in g.outputs]
    return b.build(outputs, g.attrs)
