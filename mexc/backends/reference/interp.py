"""Reference executor: runs a training-step program with the reference kernels, exactly.

Each op's reference rule (OpDef.reference, mexc.ops) maps a node and its input values onto a
kernel of `mexc.kernels` or a primitive of `mexc.numerics`. The executor is the executable form
of the program's meaning; every backend must reproduce its state bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mexc.ir import Graph, Node, Op, Value, in_forward
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import AdamConfig, FixedScalar
from mexc.ops import op_def


@dataclass
class StepEnv:
    """What one execution needs besides the node inputs."""

    ctx: RoundCtx
    train: bool
    x: np.ndarray
    y: np.ndarray | None
    state: dict[str, MX]
    lr: FixedScalar = field(default_factory=lambda: FixedScalar(0, 0))
    momentum: FixedScalar = field(default_factory=lambda: FixedScalar(0, 0))
    weight_decay: FixedScalar = field(default_factory=lambda: FixedScalar(0, 0))
    valid: int = 0
    peak_bytes: int = 0  # set by execute: the most bytes its live values held at once
    # the context of the forward graph's nodes (rid < forward_rids; Graph.is_forward), where the
    # program's rounding mode rounds them differently from the rest (docs/numerics.md §4)
    forward_ctx: RoundCtx | None = None
    forward_rids: int = 0
    adam: AdamConfig | None = None  # an AdamW program's constants of this step
    # a data-parallel worker's step: the nodes that read its rows of the batch (split_nodes);
    # the others (the updates, anything computed from parameters alone) run without ctx.rows
    split: frozenset[int] | None = None


Rule = Callable[[Node, list[Any], StepEnv], tuple[Any, ...]]


def infer(
    nodes: list[Node], env: StepEnv, output: Value, last_use: dict[Value, int] | None = None
) -> MX | Acc:
    """Run the inference nodes that compute `output` (the logits) and return it. When its
    producer, the last node, is a product, its output compaction is skipped: the logits stay
    the int32 accumulator, so near-equal classes are not rounded into ties (§15)."""
    *body, last = nodes
    values = execute(body, env, last_use)
    args = [values[v] for v in last.inputs]
    wide = op_def(last.op).reference_wide
    if wide is not None and last.result(0) == output:
        return wide(last, args, env)
    results = _rule(last)(last, args, env)
    return next(r for i, r in enumerate(results) if last.result(i) == output)


def _rule(n: Node) -> Rule:
    rule = op_def(n.op).reference
    if rule is None:
        raise NotImplementedError(f"the reference executor has no rule for {n.op.value}")
    return rule


def value_bytes(v: Any) -> int:
    """Bytes of an executor value's arrays (an MX: mantissas and exponents; tuples summed)."""
    if isinstance(v, np.ndarray):
        return int(v.nbytes)
    if isinstance(v, MX):
        return int(np.asarray(v.m).nbytes + np.asarray(v.e).nbytes)
    if isinstance(v, Acc):
        return int(np.asarray(v.a).nbytes + np.asarray(v.e).nbytes)
    if isinstance(v, (tuple, list)):
        return sum(value_bytes(x) for x in v)
    return 0


def execute(
    nodes: list[Node], env: StepEnv, last_use: dict[Value, int] | None = None
) -> dict[Value, Any]:
    """Run `nodes` in order; returns every computed value. Values past their last use are freed.
    env.peak_bytes gets the peak of the live values' bytes (kernel temporaries not counted)."""
    values: dict[Value, Any] = {}
    live = peak = 0
    base = env.ctx
    whole = {id(c): replace(c, rows=None) for c in (base, env.forward_ctx) if c is not None}
    for pos, n in enumerate(nodes):
        ctx = base
        if env.forward_ctx is not None and in_forward(n, env.forward_rids):
            ctx = env.forward_ctx
        if env.split is not None and n.id not in env.split:
            ctx = whole[id(ctx)]
        env.ctx = ctx
        results = _rule(n)(n, [values[v] for v in n.inputs], env)
        for i, r in enumerate(results):
            values[n.result(i)] = r
            live += value_bytes(r)
        peak = max(peak, live)
        if last_use is not None:
            for v in dict.fromkeys(n.inputs):  # a value read twice (concat) is freed once
                if last_use.get(v, -1) == pos:
                    live -= value_bytes(values.pop(v))
    env.ctx = base
    env.peak_bytes = peak
    return values


def split_nodes(g: Graph) -> frozenset[int]:
    """The nodes of a data-parallel worker's graph (after shard-batch) that read its rows of
    the batch (those with an input derived from the batch), and the all_reduce nodes. A result
    stops being the worker's rows where an all_reduce adds it over the workers, or where the
    op computes it over the whole batch (OpDef.batch_whole)."""
    reduced = {v for n in g.nodes if n.op is Op.ALL_REDUCE for v in n.inputs}
    rows: set[Value] = set()
    out: set[int] = set()
    for n in g.nodes:
        d = op_def(n.op)
        if n.op is Op.ALL_REDUCE:  # it adds over the workers: it needs them, not their rows
            out.add(n.id)
            continue
        if not d.batch_major(n) and not any(v in rows for v in n.inputs):
            continue
        out.add(n.id)
        for i in range(len(n.types)):
            v = n.result(i)
            if v not in reduced and i not in d.batch_whole:
                rows.add(v)
    return frozenset(out)


def last_uses(nodes: list[Node], keep: set[Value]) -> dict[Value, int]:
    """Position of the last reader of each value; values in `keep` are never freed."""
    out: dict[Value, int] = {}
    for pos, n in enumerate(nodes):
        for v in n.inputs:
            if v not in keep:
                out[v] = pos
    return out
