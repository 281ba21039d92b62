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

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tvm_ffi
from tvm import tirx

from mexc.arena import live_bytes
from mexc.backends.plan_layout import lifetimes, nbytes, persistent_names
from mexc.backends.plan_runtime import PLAN_FIELDS
from mexc.ir import Graph, Value, needed_nodes
from mexc.lowering.devices import Device, HostGemm, device_of
from mexc.lowering.plan_attention import AttentionRules
from mexc.lowering.plan_core import I64, HostLaunch, Launch, StepPlan, View, unsupported
from mexc.lowering.plan_dense import DenseRules
from mexc.lowering.plan_norm import NormRules
from mexc.lowering.plan_pool import PoolRules
from mexc.lowering.plan_transformer import TransformerRules
from mexc.lowering.te_func import trial_kernels
from mexc.numerics import site_rounding
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


# the lean search (build_plan): at most LEAN_TRIALS rounds; a node is tried only where its
# buffers hold at least 1/LEAN_MIN_SHARE of the peak, and a level kept only where it lowers
# the peak by 1/LEAN_MIN_DROP; the lean nodes together may add at most LEAN_WORK_SHARE to the
# step's estimated work (PlanBuilder.work)
LEAN_TRIALS = 16
LEAN_MIN_SHARE = 16
LEAN_MIN_DROP = 256
LEAN_WORK_SHARE = 0.13


def _host_gemm(device: Device, lanes: int, gemm_kernel: str) -> tuple[int, Device, str]:
    """(lanes, device, gemm_kernel) for a builder: the host GEMM's lanes and kernel shape a
    host plan only. A GPU plan takes the defaults, so that the host twin on any CPU (which
    passes its own) builds the very plan the CUDA artifact runs: the kernel's cost per MAC
    steers the lean search, which had chunked one of SmallResNet's channel-exponent products
    differently on this VNNI host than in the CUDA build."""
    if isinstance(device.gemm, HostGemm):
        return lanes, device, gemm_kernel
    return 8, device, "int32"


def build_plan(
    prog: Program,
    lanes: int = 8,
    device: str | Device = "cpu",
    gemm_kernel: str = "int32",
    pack_budget: int | None = None,
    lean: Mapping[int, int] | None = None,
) -> StepPlan:
    """The launch plan of `prog`'s training step (UnsupportedOpError for ops not lowered yet);
    `lanes`: int32 lanes of the host's vectors, for the GEMM tiles; `device`: a devices.Device
    or its name, "cpu" (devices.HOST) or "gpu" (devices.GPU); `gemm_kernel`: the host GEMM's
    kernel (cpu_gemm.GEMM_KERNELS); `pack_budget`: bytes a product's packs may take before it
    runs in batch chunks (default the device's pack_budget; a huge value turns chunking off,
    for measurements). `lean`: node -> lean level (PlanBuilder.lean_product: smaller chunks,
    then scan-then-round: no int32 tensor of the node's stored whole); None: chosen by
    `lean_nodes` where they lower the step's peak."""
    args = (prog, *_host_gemm(device_of(device), lanes, gemm_kernel), pack_budget)
    if lean is not None:
        return plan_builder(*args, lean).plan
    # the searches' builds are trials: their kernels are not run (trial_kernels), the plan
    # of what they chose is built again, kernels and all
    with trial_kernels():
        recompute, first = recompute_search(lambda r: plan_builder(*args, {}, r))
        chosen, b = lean_search(lambda c: plan_builder(*args, c, recompute), first)
        if pack_budget is None:  # a budget the caller chose stays every product's
            b = widen_packs(lambda wide: plan_builder(*args, chosen, recompute, wide), b)
    return plan_builder(*args, chosen, recompute, b.wide).plan


# recompute_search: at most this many rounds
RECOMPUTE_ROUNDS = 4


def recompute_search(
    build: Callable[[set[int] | None], PlanRules],
) -> tuple[set[int], PlanRules]:
    """The batchnorm_affine nodes (the rematerialize pass's copies) that recompute, and the
    build with them. A copy costs an elementwise pass and saves bytes only where its kept
    forward value would be live at the step's peak: starting from none, every copy whose
    forward value is live at the peak recomputes, while that lowers the peak by
    1/LEAN_MIN_DROP (FashionCNN's peak is in its forward pass: no copy; ResNet-18's is where
    its backward pass starts: every copy of a value kept to there)."""
    chosen: set[int] = set()
    b = build(chosen)
    peak, live = plan_peak(b.plan)
    for _ in range(RECOMPUTE_ROUNDS):
        more = {a for a, name in b.recomputable.items() if a not in chosen and name in live}
        if not more:
            break
        trial = build(chosen | more)
        trial_peak, trial_live = plan_peak(trial.plan)
        if (peak - trial_peak) * LEAN_MIN_DROP < peak:
            break
        chosen, b, peak, live = chosen | more, trial, trial_peak, trial_live
    return chosen, b


def leanest(prog: Program, device: str | Device = "cpu") -> dict[int, int]:
    """Every leanable node of `prog` at its highest lean level (tests and measurements)."""
    return dict(plan_builder(prog, 8, device_of(device), "int32", None, {}).leanable)


def lean_nodes(build: Callable[[Mapping[int, int]], PlanRules]) -> dict[int, int]:
    """The lean level of each node (lean_search)."""
    return lean_search(build)[0]


def lean_search(
    build: Callable[[Mapping[int, int]], PlanRules], first: PlanRules | None = None
) -> tuple[dict[int, int], PlanRules]:
    """The lean level of each node, and the build with those levels (the search built it already:
    the plan needs no build of its own). A lean node trades time (more chunks and launches; at
    a nearest site a product computed twice; a bracket three times) for memory, so only the
    nodes that set the step's peak may pay it: while the live buffers at the peak (plan_peak)
    include those of a node whose rule has a further lean level (at least 1/LEAN_MIN_SHARE of
    the peak), the one holding the most bytes there goes to its cheapest higher level that
    lowers the peak (by 1/LEAN_MIN_DROP) within the work budget (LEAN_WORK_SHARE of the step's
    work); the levels tried are not tried again, and the next node is taken where none did.
    `first`: the build without lean nodes, where the caller has it."""
    chosen: dict[int, int] = {}
    b = first if first is not None else build(chosen)
    base = b.work
    budget = base * (1 + LEAN_WORK_SHARE)
    peak, live = plan_peak(b.plan)
    tried: set[tuple[int, int]] = set()
    for _ in range(LEAN_TRIALS):
        held: dict[int, int] = {}
        for name, size in live.items():
            o = b.owner.get(name, -1)
            up = chosen.get(o, 0) + 1
            if up <= b.leanable.get(o, 0) and (o, up) not in tried:
                held[o] = held.get(o, 0) + size
        order = sorted(held, key=lambda o: -held[o])
        worth = [o for o in order if held[o] * LEAN_MIN_SHARE >= peak]
        if not worth:
            break
        node = worth[0]
        # its cheapest level above the present one that lowers the peak by at least
        # 1/LEAN_MIN_DROP within the work budget (the others are not tried again)
        for level in range(chosen.get(node, 0) + 1, b.leanable[node] + 1):
            trial = build({**chosen, node: level})
            trial_peak, trial_live = plan_peak(trial.plan)
            if os.environ.get("MEXC_LEAN_TRACE"):
                print(
                    f"lean: node {node} level {level} holds {held[node]} of {peak}: peak "
                    f"{trial_peak}, work {trial.work / base - 1:+.3f}"
                )
            tried.add((node, level))
            if trial.work <= budget and (peak - trial_peak) * LEAN_MIN_DROP >= peak:
                chosen, b, peak, live = {**chosen, node: level}, trial, trial_peak, trial_live
                break
    return chosen, b


# widen_packs: at most this many builds
WIDEN_ROUNDS = 4


def widen_packs(build: Callable[[Mapping[int, int]], PlanRules], b: PlanRules) -> PlanRules:
    """The build `b` with each product that the pack budget split into chunks given a
    budget of its own, on a device whose launches cost more than their memory
    (Device.packs_within_peak): its chunk's packs plus the room its launches leave below the
    step's peak (plan_peak's live bytes), so that it runs in fewer, larger chunks and the peak
    stays. `build(wide)`: the build with node -> budget. Where a build's peak rises all the
    same (bytes a chunk holds beyond the packs the budget counts), the widened nodes holding
    bytes at the new peak give up the excess, and the search builds again; after
    WIDEN_ROUNDS, `b`."""
    if not b.device.packs_within_peak or not b.chunked_packs:
        return b
    peak, curve, _ = live_curve(b.plan)
    spans: dict[int, tuple[int, int]] = {}  # node -> its first and last launch
    for t, node in enumerate(b.launch_nodes):
        spans[node] = (spans.get(node, (t, t))[0], t)
    wide: dict[int, int] = {}
    for node, (chunk, most) in b.chunked_packs.items():
        first, last = spans[node]
        span = curve[first : last + 1]
        room = peak - int(span.max()) if len(span) else 0
        if room > 0:
            wide[node] = min(chunk + room, most)
    for _ in range(WIDEN_ROUNDS):
        if not wide:
            break
        trial = build(wide)
        trial_peak, live = plan_peak(trial.plan)
        if trial_peak <= peak:
            return trial
        over = trial_peak - peak
        holders = {trial.owner.get(name, -1) for name in live}
        for node in holders & set(wide):
            wide[node] -= over
            if wide[node] <= b.chunked_packs[node][0]:
                del wide[node]
    return b


def live_curve(plan: StepPlan) -> tuple[int, np.ndarray, dict[str, int]]:
    """The most arena bytes live during one launch (plan_layout's lifetimes; the persistent
    region apart), the live bytes at each launch, and the bytes of each buffer live at the
    most."""
    m = plan_manifest(plan)
    args = [list(x.args) for x in plan.launches]
    life = lifetimes(m, args)
    keep = persistent_names(m)
    sizes = {k: nbytes(s, d) for k, (s, d) in plan.buffers.items() if k in life and k not in keep}
    curve = live_bytes([(*life[k], size, k) for k, size in sizes.items()])
    if not len(curve):
        return 0, curve, {}
    t = int(curve.argmax())
    live = {k: z for k, z in sizes.items() if life[k][0] <= t <= life[k][1]}
    return int(curve[t]), curve, live


def plan_peak(plan: StepPlan) -> tuple[int, dict[str, int]]:
    """The most arena bytes live during one launch (live_curve), and the bytes of each
    buffer live there."""
    peak, _, live = live_curve(plan)
    return peak, live


def plan_builder(
    prog: Program,
    lanes: int,
    device: Device,
    gemm_kernel: str,
    pack_budget: int | None,
    lean: Mapping[int, int],
    recompute: set[int] | None = None,
    wide: Mapping[int, int] | None = None,
) -> PlanRules:
    """The builder after every op's rule has run (its plan, its lean candidates and work);
    `recompute`: the batchnorm_affine nodes that recompute (None: all); `wide`: node -> the
    pack budget of its products (widen_packs)."""
    b = PlanRules(prog, lanes, device, gemm_kernel, pack_budget)
    b.lean = lean
    b.recompute = recompute
    b.wide = dict(wide or {})
    mode = prog.options.rounding
    for n in prog.graph.nodes:
        rule = op_def(n.op).lowering("llvm")
        if rule is None:
            raise unsupported(
                n,
                f"op `{n.op.value}` is not lowered to TVM yet (lowered: {', '.join(SUPPORTED)})",
            )
        b.node = n.id
        b.rows = b.world > 1 and n.id in b.rows_nodes
        # the program's rounding mode may round the forward nodes differently (numerics §4)
        b.stochastic = site_rounding(mode, prog.graph.is_forward(n)) == "stochastic"
        rule(b, n)
    _check_in_place_updates(prog.graph)
    b.buf(b.plan.keys, (max(len(b.plan.key_ids), 1),), I64)
    return b


def build_inference_plan(
    prog: Program,
    lanes: int = 8,
    device: str | Device = "cpu",
    gemm_kernel: str = "int32",
    pack_budget: int | None = None,
) -> StepPlan:
    """The launch plan of `prog`'s inference path (Program.logits): the nodes the logits need
    (ir.needed_nodes), in eval mode and rounding to nearest, as the reference's `infer`
    runs them. An op's "tir_eval" rule where it has one (batch norm on the running statistics,
    dropout off), else its "tir" rule; the product that computes the logits by its "tir_wide"
    rule (the int32 accumulator and its exponent, OpDef.reference_wide). The parameters and
    running statistics are the training plan's state buffers, by the same names ("state:<name>"):
    a runtime that shares them sees the live state without copying it. No rule writes in place
    (the training step's memory plan does not hold for this subgraph), and nothing writes the
    state. Batch: the program's; plan.logits names the result."""
    b = PlanRules(prog, *_host_gemm(device_of(device), lanes, gemm_kernel), pack_budget)
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
        if isinstance(launch, HostLaunch):  # a collective the host runs: no kernel
            continue
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


def check_launch_args(plan: StepPlan) -> None:
    """ValueError unless every kernel launch passes as many buffers as its PrimFunc takes, each
    of the parameter's dtype and shape (a symbolic extent one value throughout a launch). The
    host kernels are compiled without TVM's per-call argument checks (kernel_store), so the
    plan is checked here once, when it is built."""
    for launch in plan.launches:
        if isinstance(launch, HostLaunch):
            continue
        params = launch.func.params
        if len(params) != len(launch.args):
            raise ValueError(
                f"launch {launch.symbol}: {len(launch.args)} buffers for {len(params)} parameters"
            )
        bound: dict[str, int] = {}  # symbolic extent -> its value in this launch
        for param, arg in zip(params, launch.args):
            shape, dtype = plan.buffer_shape(arg), plan.buffer_dtype(arg)
            if not _fits(param, shape, dtype, bound):
                raise ValueError(
                    f"launch {launch.symbol}: buffer {arg} ({dtype} {list(shape)}) does not fit "
                    f"parameter {param.name} ({param.dtype} {[str(d) for d in param.shape]})"
                )


def _fits(param: Any, shape: tuple[int, ...], dtype: str, bound: dict[str, int]) -> bool:
    """Whether a buffer of `shape` and `dtype` fits PrimFunc parameter `param`; a symbolic
    extent (the per-shape update kernels) takes its first value in `bound`."""
    if str(param.dtype) != dtype or len(param.shape) != len(shape):
        return False
    for dim, got in zip(param.shape, shape):
        want = int(dim) if isinstance(dim, tirx.IntImm) else bound.setdefault(str(dim), int(got))
        if want != int(got):
            return False
    return True


def plan_manifest(plan: StepPlan) -> dict[str, Any]:
    """The plan's buffers and host-facing names as JSON (plan_runtime.PLAN_FIELDS); each
    backend adds how its kernels are launched."""
    out = {
        "buffers": {k: [list(s), d] for k, (s, d) in plan.buffers.items()},
        "views": {k: [v.base, list(v.shape), v.offset] for k, v in plan.views.items()},
        "constants": {k: [v.dtype.str, v.tolist()] for k, v in plan.constants.items()},
        "keys": plan.keys,
        "key_ids": plan.key_ids,
        "key_rows": plan.key_rows,
        "state": plan.state,
        "input": list(plan.input),
        "labels": plan.labels,
        "valid": plan.valid,
        "lr": plan.lr,
        "loss_rows": plan.loss_rows,
    }
    assert tuple(out) == PLAN_FIELDS
    if any(plan.logits):  # an inference plan (build_inference_plan)
        out["logits"] = list(plan.logits)
    return out
