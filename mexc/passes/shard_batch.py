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

from mexc.errors import InputError, UnsupportedOpError
from mexc.ir import Graph, GraphBuilder, Node, Op, Value
from mexc.ops import attrs, op_def, with_attrs
from mexc.pass_manager import PassContext
from mexc.types import TensorType


def _rows_of(t: TensorType, world: int, n: Node, what: str, axis: int = 0) -> TensorType:
    if len(t.shape) <= axis or t.shape[axis] % world:
        raise UnsupportedOpError(
            f"data parallel: {what} of node %{n.id} ({n.op.value}{', ' + n.loc if n.loc else ''}) "
            f"has shape {list(t.shape)}, whose batch axis does not split into {world} equal "
            "shares of rows; choose a global batch that is a multiple of the number of workers"
        )
    shape = list(t.shape)
    shape[axis] //= world
    return TensorType(t.kind, tuple(shape), t.exp)


def _refuse(n: Node, why: str) -> UnsupportedOpError:
    where = f" at {n.loc}" if n.loc else ""
    return UnsupportedOpError(
        f"data parallel: node %{n.id} ({n.op.value}){where} {why}, so its batch cannot be "
        "split over workers; train this model in one process (data_parallel=False), or "
        "replace the layer (docs/distributed.md lists the ops that split)"
    )


def shard_batch(g: Graph, ctx: PassContext) -> Graph:
    world = ctx.world
    if world <= 1:
        return g
    ctx.results["global_graph"] = g
    batch = int(g.attr("batch"))
    if batch % world:  # bad input (the example batch), not an op mexc lacks
        raise InputError(
            f"data parallel: the global batch of {batch} does not split into {world} equal "
            f"shares; choose a global batch that is a multiple of {world}"
        )
    b = GraphBuilder(g.next_id())
    types = {v: t for n in g.nodes for v, t in ((n.result(i), t) for i, t in enumerate(n.types))}
    axis: dict[Value, int] = {}  # the batch axis of every split value
    remap: dict[Value, Value] = {}
    for n in g.nodes:
        n = n.with_(inputs=tuple(remap.get(v, v) for v in n.inputs))
        d = op_def(n.op)
        if d.batch_major(n):  # the batch, the labels: the worker's rows
            # the batch itself, or windows merged into it (whole batches of rows): a value
            # made for one sample has fewer rows than the batch
            if any(not t.shape or t.shape[0] % batch for t in n.types):
                raise _refuse(
                    n,
                    "makes a value for one sample that the model repeats over the batch (a "
                    "positional encoding projected once)",
                )
            b.keep(n.with_(types=tuple(_rows_of(t, world, n, "the batch") for t in n.types)))
            axis.update((n.result(i), 0) for i in range(len(n.types)))
            continue
        split = [v for v in n.inputs if v in axis]
        if not split:
            b.keep(n)
            continue
        if d.moves_batch is not None:  # data movement: the batch axis may go anywhere
            src = split[0]
            to = d.moves_batch(n, types[src], axis[src])
            if to is None:
                raise _refuse(n, "moves data across the batch axis")
            b.keep(_moved(n, world, to))
            axis[n.out] = to
            continue
        if not d.splits(n):
            raise _refuse(n, "has no data-parallel rule yet (or not with these attributes)")
        if any(axis[v] for v in split):
            raise _refuse(n, "reads a value whose batch axis is not its first")
        partial = d.partial_results(n, [types[v] for v in n.inputs])
        local: list[TensorType] = []
        for i, t in enumerate(n.types):
            if i in partial or i in d.batch_whole:
                local.append(t)
            else:
                local.append(_rows_of(t, world, n, f"result {i}"))
                axis[n.result(i)] = 0
        b.keep(n.with_(types=tuple(local)))
        for i in partial:
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


def _moved(n: Node, world: int, to: int) -> Node:
    """A data-movement node over the worker's rows: its result split along axis `to` (a
    reshape's target shape too)."""
    kept = n.with_(types=(_rows_of(n.type, world, n, "its result", to),))
    shape = getattr(n.attrs, "shape", None)
    if shape:
        target = list(shape)
        target[to] = int(target[to]) // world
        kept = kept.with_(attrs=with_attrs(n.op, n.attrs, shape=tuple(target)))
    return kept
