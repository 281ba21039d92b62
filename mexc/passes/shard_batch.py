"""shard-batch: the step of one data-parallel worker, which holds 1/world of the batch.

Requires: the training-step program (after insert-optimizer), whose batch is the global batch.
  ctx.world: the number of workers (1: the pass changes nothing).
Ensures: every batch-major value (the batch, the labels, and what the ops compute from them,
  OpDef.data_parallel) has the worker's rows: its leading extent is divided by `world` (a
  reshape's target shape too); every result that is a worker's share of a sum over the batch
  (OpDef.batch_partial: the weight and bias gradients) is followed by an ALL_REDUCE node whose
  sum its readers take instead, so the optimizer sees the whole batch's int32 gradient. The
  decisions inside the batch-major kernels (per-tensor maxima, batch-norm sums, the loss
  count, the PRNG's element index) are agreed by the kernels through the step's RoundCtx.rows
  (docs/numerics.md §16). Graph attributes: `batch` (the worker's rows), `global_batch`,
  `world`. The program before the pass is kept in ctx.results["global_graph"] (inference and
  checkpoints use it: they do not depend on the number of workers).
"""

from __future__ import annotations

from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, GraphBuilder, Node, Op, Value
from mexc.ops import attrs, op_def, with_attrs
from mexc.pass_manager import PassContext
from mexc.types import TensorType

SHARDED_BOUNDARY = (Op.INPUT, Op.LABEL)


def _rows_of(t: TensorType, world: int, n: Node, what: str) -> TensorType:
    if not t.shape or t.shape[0] % world:
        raise UnsupportedOpError(
            f"data parallel: {what} of node %{n.id} ({n.op.value}{', ' + n.loc if n.loc else ''}) "
            f"has shape {list(t.shape)}, whose leading axis does not split into {world} equal "
            "shares of rows; choose a global batch that is a multiple of the number of workers"
        )
    return TensorType(t.kind, (t.shape[0] // world, *t.shape[1:]), t.exp)


def shard_batch(g: Graph, ctx: PassContext) -> Graph:
    world = ctx.world
    if world <= 1:
        return g
    ctx.results["global_graph"] = g
    batch = int(g.attr("batch"))
    if batch % world:
        raise UnsupportedOpError(
            f"data parallel: the global batch of {batch} does not split into {world} equal "
            f"shares; choose a global batch that is a multiple of {world}"
        )
    b = GraphBuilder(g.next_id())
    sharded: set[Value] = set()
    remap: dict[Value, Value] = {}
    for n in g.nodes:
        n = n.with_(inputs=tuple(remap.get(v, v) for v in n.inputs))
        d = op_def(n.op)
        if n.op in SHARDED_BOUNDARY:
            b.keep(n.with_(types=(_rows_of(n.type, world, n, "the batch"),)))
            sharded.add(n.out)
            continue
        if not any(v in sharded for v in n.inputs):
            b.keep(n)
            continue
        if not d.data_parallel:
            where = f" at {n.loc}" if n.loc else ""
            raise UnsupportedOpError(
                f"data parallel: node %{n.id} ({n.op.value}){where} has no data-parallel rule "
                "yet, so its batch cannot be split over workers; train this model in one "
                "process (data_parallel=False), or replace the layer (docs/distributed.md "
                "lists the ops that split)"
            )
        types = []
        for i, t in enumerate(n.types):
            if i in d.batch_partial or i in d.batch_whole:
                types.append(t)
            else:
                types.append(_rows_of(t, world, n, f"result {i}"))
                sharded.add(n.result(i))
        kept = n.with_(types=tuple(types))
        shape = getattr(n.attrs, "shape", None)
        if shape:  # a reshape's target: the worker's rows
            local = (int(shape[0]) // world, *shape[1:])
            kept = kept.with_(attrs=with_attrs(n.op, n.attrs, shape=local))
        b.keep(kept)
        for i in d.batch_partial:
            total = b.add(
                Op.ALL_REDUCE,
                [n.result(i)],
                n.types[i],
                attrs(Op.ALL_REDUCE, reduce="sum", world=world),
                n.loc,
            )
            remap[n.result(i)] = total.out
    outputs = [(name, remap.get(v, v)) for name, v in g.outputs]
    extra = {"batch": batch // world, "global_batch": batch, "world": world}
    return b.build(outputs, g.with_attrs(**extra).attrs)
