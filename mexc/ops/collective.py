"""Collectives of a data-parallel step (the shard-batch pass, docs/numerics.md §16)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mexc.errors import DistributedError
from mexc.ir import Node, Op
from mexc.mx import Acc
from mexc.numerics import check_int32
from mexc.ops.registry import OpDef, define


def _all_reduce(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    rows = env.ctx.rows
    if rows is None:
        raise DistributedError(
            f"node %{n.id} ({n.op.value}) needs the data-parallel workers of the step, but this "
            "program runs in one process: compile it with data_parallel=True inside a process "
            "where torch.distributed is initialised (docs/distributed.md)"
        )
    part: Acc = a[0]
    # every worker's exponent is the same (its operands' exponents were agreed), so the shares
    # add as integers; their sum is the whole batch's accumulator, bit for bit
    total = rows.sum(part.a)
    check_int32(total, "all_reduce")
    return (Acc(np.asarray(total, np.int64), part.e),)


define(
    OpDef(
        Op.ALL_REDUCE,
        {"reduce": "sum", "world": 0},
        reference=_all_reduce,
        lower={"tir": "step_plan:PlanRules.all_reduce"},
        doc="data parallel: the workers' shares of an int32 batch sum, added (all_reduce SUM)",
    ),
)
