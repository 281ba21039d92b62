"""The named compilation pipeline: float graph -> integer training-step program."""

from __future__ import annotations

from mexc.pass_manager import Pass
from mexc.passes.assign_shift_caps import assign_shift_caps
from mexc.passes.derive_backward import derive_backward
from mexc.passes.fuse_products import fuse_products
from mexc.passes.insert_mx_types import insert_mx_types
from mexc.passes.insert_optimizer import insert_optimizer
from mexc.passes.plan_memory import plan_memory
from mexc.passes.rematerialize import rematerialize
from mexc.passes.shard_batch import shard_batch

PIPELINE: tuple[Pass, ...] = (
    Pass(
        "insert-mx-types",
        insert_mx_types,
        "quantize the input, give every value an MX/acc type, assign rounding sites",
        integer_only_after=True,
    ),
    Pass("fuse-products", fuse_products, "fuse each product with the compaction of its int32 acc"),
    Pass(
        "assign-shift-caps",
        assign_shift_caps,
        "prove int32 headroom of every product and sum; pre-shift where a cap is negative",
        caps_after=True,
    ),
    Pass(
        "derive-backward",
        derive_backward,
        "append the backward graph from per-op VJP rules; gradients of all parameters",
    ),
    Pass(
        "rematerialize",
        rematerialize,
        "recompute batch-norm outputs (and their ReLU) for the backward pass, not saving them",
    ),
    Pass(
        "insert-optimizer",
        insert_optimizer,
        "integer SGD+momentum or AdamW with per-group state, reactive rescale, BN running stats",
    ),
    Pass(
        "shard-batch",
        shard_batch,
        "data parallel: this worker's rows of the batch, all_reduce of the gradient shares",
    ),
    Pass(
        "plan-memory",
        plan_memory,
        "liveness: persistent / saved / transient bytes and a static first-fit arena",
    ),
)


def pass_names() -> list[str]:
    return [p.name for p in PIPELINE]
