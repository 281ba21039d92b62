"""The launch plan of a whole training step: every op of the program as TIR kernels over named
device buffers, for one target device (devices.Device: HOST for the llvm backend, GPU for the
CUDA backend). The kernels are target-independent TE except the products, which the device's
GEMM strategy lowers (cpu_gemm's register tiles on the host, gemm_forms' padded GEMMs on a
GPU), and the few rules a device's capabilities choose (direct depthwise and sub-pixel kernels,
symbolic update kernels, the weight gradient's orientation, the batch-norm bracket's maxima).

A value of the graph lives in two buffers: its mantissas (int8, or int32 for an accumulator) and
its exponent (int32[1], or int32[groups] for a per-group velocity). Exponents are computed on the
device by the kernels themselves (compaction shifts, aligned-sum targets, exponent sums), so the
host never reads one during a step. Per step the host writes only the batch (quantized at the
float boundary, which is the one place float is allowed), the labels, the learning rate as a
(numerator, shift) pair and the stream keys of the rounding sites (counter-based PRNG keys of
(seed, step, tensor id)); everything else, the state included, stays in the plan's buffers.
Parameters are updated in place: a parameter's update is the last reader of its old value.

Ops lowered: every op of the CNN examples (convolutions incl. grouped and depthwise, linear,
batch norm with running statistics, ReLU / ReLU6, max / average / global pooling, residual and
gradient sums, dropout, the softmax cross-entropy head, their gradients, the SGD update), and
the ops of a ViT: the tensor ops (transpose, slice, scale, broadcast parameter add, token
mean, GELU and their gradients: plan_transformer) and attention's batched matmul, the row softmax
and LayerNorm (plan_attention). Ops without a "tir" lowering raise UnsupportedOpError naming the
node, so `compile(..., target="llvm")` refuses instead of computing something else (`auto` falls
back to the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm_ffi
from tvm import tirx

from mexc.backends.plan_runtime import PLAN_FIELDS
from mexc.backends.reference.interp import needed_nodes
from mexc.ir import Graph, Value
from mexc.lowering.devices import Device, device_of
from mexc.lowering.plan_attention import AttentionRules
from mexc.lowering.plan_core import I64, Launch, StepPlan, View, unsupported
from mexc.lowering.plan_dense import DenseRules
from mexc.lowering.plan_norm import NormRules
from mexc.lowering.plan_pool import PoolRules
from mexc.lowering.plan_transformer import TransformerRules
from mexc.ops import REGISTRY, op_def
from mexc.program import Program

__all__ = ["Launch", "StepPlan", "View", "build_inference_plan", "build_plan", "SUPPORTED"]


class PlanRules(DenseRules, NormRules, PoolRules, TransformerRules, AttentionRules):
    """Every op's TIR lowering over one builder state; the registry (OpDef.lower["tir"]) names
    the method of each op."""


SUPPORTED = tuple(sorted(op.value for op, d in REGISTRY.items() if "tir" in d.lower))


def _check_in_place_updates(g: Graph) -> None:
    """An update overwrites the buffers of the state it updates: no later node may read them."""
    pos = {n.id: i for i, n in enumerate(g.nodes)}
    readers: dict[Value, list[int]] = {}
    for n in g.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(pos[n.id])
    for n in g.nodes:
        for i in op_def(n.op).overwrites:
            if max(readers.get(n.inputs[i], [0])) > pos[n.id]:
                raise unsupported(n, "a node after the update reads the state it overwrites")


def build_plan(
    prog: Program,
    lanes: int = 8,
    device: str | Device = "cpu",
    gemm_kernel: str = "int32",
    pack_budget: int | None = None,
) -> StepPlan:
    """The launch plan of `prog`'s training step (UnsupportedOpError for ops not lowered yet);
    `lanes`: int32 lanes of the host's vectors, for the GEMM tiles; `device`: a devices.Device
    or its name, "cpu" (devices.HOST) or "gpu" (devices.GPU); `gemm_kernel`: the host GEMM's
    kernel (cpu_gemm.GEMM_KERNELS); `pack_budget`: bytes a product's packs may take before it
    runs in batch chunks (default the device's pack_budget; a huge value turns chunking off,
    for measurements)."""
    b = PlanRules(prog, lanes, device_of(device), gemm_kernel, pack_budget)
    for n in prog.graph.nodes:
        rule = op_def(n.op).lowering("llvm")
        if rule is None:
            raise unsupported(
                n,
                f"op `{n.op.value}` is not lowered to TVM yet (lowered: {', '.join(SUPPORTED)})",
            )
        rule(b, n)
    _check_in_place_updates(prog.graph)
    b.buf(b.plan.keys, (max(len(b.plan.key_ids), 1),), I64)
    return b.plan


def build_inference_plan(
    prog: Program,
    lanes: int = 8,
    device: str | Device = "cpu",
    gemm_kernel: str = "int32",
    pack_budget: int | None = None,
) -> StepPlan:
    """The launch plan of `prog`'s inference path (Program.logits): the nodes the logits need
    (interp.needed_nodes), in eval mode and rounding to nearest, as the reference's `infer`
    runs them. An op's "tir_eval" rule where it has one (batch norm on the running statistics,
    dropout off), else its "tir" rule; the product that computes the logits by its "tir_wide"
    rule (the int32 accumulator and its exponent, OpDef.reference_wide). The parameters and
    running statistics are the training plan's state buffers, by the same names ("state:<name>"):
    a runtime that shares them sees the live state without copying it. No rule writes in place
    (the training step's memory plan does not hold for this subgraph), and nothing writes the
    state. Batch: the program's; plan.logits names the result."""
    b = PlanRules(prog, lanes, device_of(device), gemm_kernel, pack_budget)
    b.stochastic = False  # the inference path rounds to nearest (Program.logits)
    b.in_place = set()
    out = prog.graph.output("logits")
    nodes = needed_nodes(prog.graph, ["logits"])
    for n in nodes:
        d = op_def(n.op)
        if n is nodes[-1] and d.reference_wide is not None and n.result(0) == out:
            rule = d.resolve("tir_wide")
            missing = "its accumulator form for the logits (tir_wide)"
        else:
            rule = d.resolve("tir_eval") or d.resolve("tir")
            missing = "its eval-mode form"
        if rule is None:
            raise unsupported(n, f"op `{n.op.value}` is not lowered to TVM yet ({missing})")
        rule(b, n)
    b.plan.logits = (b.m[out], b.e[out])
    b.buf(b.plan.keys, (max(len(b.plan.key_ids), 1),), I64)
    return b.plan


def distinct_kernels(
    plan: StepPlan, schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc]
) -> tuple[dict[str, tirx.PrimFunc], dict[str, str]]:
    """One scheduled PrimFunc per distinct kernel of the plan (equal up to its name, e.g. the
    compactions of equal shapes), and every launch's symbol -> the symbol that implements it."""
    reps: dict[int, list[tuple[str, tirx.PrimFunc]]] = {}
    funcs: dict[str, tirx.PrimFunc] = {}
    alias: dict[str, str] = {}
    for launch in plan.launches:
        anon = launch.func.with_attr("global_symbol", "k")
        bucket = reps.setdefault(tvm_ffi.structural_hash(anon), [])
        for symbol, other in bucket:
            if tvm_ffi.structural_equal(anon, other):
                alias[launch.symbol] = symbol
                break
        else:
            bucket.append((launch.symbol, anon))
            alias[launch.symbol] = launch.symbol
            funcs[launch.symbol] = schedule(launch.func).with_attr("global_symbol", launch.symbol)
    return funcs, alias


def plan_manifest(plan: StepPlan) -> dict[str, Any]:
    """The plan's buffers and host-facing names as JSON (plan_runtime.PLAN_FIELDS); each
    backend adds how its kernels are launched."""
    out = {
        "buffers": {k: [list(s), d] for k, (s, d) in plan.buffers.items()},
        "views": {k: [v.base, list(v.shape), v.offset] for k, v in plan.views.items()},
        "constants": {k: [v.dtype.str, v.tolist()] for k, v in plan.constants.items()},
        "keys": plan.keys,
        "key_ids": plan.key_ids,
        "state": plan.state,
        "input": list(plan.input),
        "labels": plan.labels,
        "valid": plan.valid,
        "lr": plan.lr,
        "probs": plan.probs,
    }
    assert tuple(out) == PLAN_FIELDS
    if any(plan.logits):  # an inference plan (build_inference_plan)
        out["logits"] = list(plan.logits)
    return out
