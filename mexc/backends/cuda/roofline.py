"""A roofline estimate of a CUDA training step from its launch plan (docs/cuda.md, "Roofline
estimate"), without a GPU.

Every kernel of plan.json's list (symbol, grid, block, the plan buffer behind each parameter)
gets a cost (`kernel_costs`): the bytes of every distinct argument (buffer or view, each touched
once), the integer operations (a GEMM's 2·g·M·Q·K on its padded extents, read from its operands'
shapes; any other kernel a number of operations per element by its kind) and its threads. Its
time on a `Gpu` (`kernel_time`) is, on the plain roofline, the larger of bytes / bandwidth and
operations / datasheet peak; capped, also the memory latency times the round trips its threads
need to move its bytes (Little's law) and the peak scaled to the SMs it can occupy (`Model`).
A step adds a gap per launch (`step_time`): from a CUDA graph the device runs the kernels back
to back; one by one, a kernel cannot start before the host has issued it. Pure Python over the
manifest: no TVM, no CuPy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ITEMSIZE = {"int8": 1, "int16": 2, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class Gpu:
    """Vendor datasheet peaks of one GPU (dense: no structured sparsity)."""

    name: str
    hbm_bytes_s: float  # HBM bandwidth
    int8_tensor_ops_s: float  # INT8 tensor-core operations (a MAC is 2)
    int32_ops_s: float  # INT32 CUDA-core operations (an IMAD is 2)
    sms: int
    source: str


A100 = Gpu(
    "A100 SXM4 80GB",
    2.039e12,
    624e12,
    19.5e12,
    108,
    "NVIDIA A100 datasheet (2,039 GB/s, INT8 Tensor Core 624 TOPS dense); Ampere "
    "architecture whitepaper (INT32 19.5 TOPS)",
)
H200 = Gpu(
    "H200 SXM 141GB",
    4.8e12,
    1979e12,
    33.5e12,
    132,
    "NVIDIA H200 datasheet (4.8 TB/s; INT8 Tensor Core 3,958 TOPS with sparsity, so 1,979 "
    "dense, the H100 SXM figure: same GH100 die, 132 SMs); Hopper architecture whitepaper "
    "(H100 SXM5 INT32 33.5 TOPS)",
)
GPUS = {"A100": A100, "H200": H200}


@dataclass(frozen=True)
class Model:
    """The assumptions beside the datasheet peaks (stated in docs/cuda.md)."""

    # integer operations per element of a non-GEMM kernel, by kind (kind_of): a reduction
    # loads, takes |x| and a max or sum; a rounding apply hashes (key, index) with lowbias32,
    # shifts, rounds and saturates; a gather decomposes its index by constant divisions
    ops_per_element: tuple[tuple[str, int], ...] = (
        ("reduction", 4),
        ("rounding", 40),
        ("gather", 24),
        ("elementwise", 16),
    )
    threads_per_sm: int = 2048  # resident threads per SM (sm_80 and sm_90)
    alu_threads_per_sm: int = 1024  # threads an SM needs to issue INT32 work at its peak
    mem_latency_s: float = 600e-9  # one DRAM round trip under load
    # loads a thread keeps outstanding (nvcc unrolling a reduction loop four times); a thread
    # that moves fewer bytes in all has only those in flight
    loads_in_flight: int = 4
    # a GEMM thread stages one 16-byte vector of A and one of B per K step, then waits at the
    # barrier: no multi-stage pipeline (docs/cuda.md, the GEMM schedules)
    gemm_bytes_in_flight: int = 32
    host_launch_s: float = 5e-6  # host time of one CuPy kernel launch (no graph)
    gap_s: float = 1e-6  # device time between consecutive kernels (graph or stream)

    def ops(self, kind: str) -> int:
        return dict(self.ops_per_element)[kind]


@dataclass(frozen=True)
class KernelCost:
    """What one launch moves and computes, from the plan alone."""

    index: int
    symbol: str
    family: str
    group: str
    kind: str  # gemm, reduction, rounding, gather, elementwise
    bytes: int
    ops: int
    threads: int
    blocks: int
    itemsize: int  # bytes per element of its largest argument
    macs: int  # GEMMs: padded g·M·Q·K; else 0

    @property
    def gemm(self) -> bool:
        return self.kind == "gemm"


def family_of(symbol: str) -> str:
    """The kernel's op family: its symbol without the node id, the batch-chunk suffix and
    TVM's kernel suffix ("n36_dg16_shift_kernel_3" -> "dg16_shift")."""
    name = re.sub(r"_fused\d+$", "", symbol)  # a fused run: its first kernel's (fuse.py)
    name = re.sub(r"_kernel(_\d+)?$", "", name)
    name = re.sub(r"^n\d+_", "", name)
    return re.sub(r"_k\d+$", "", name)


def group_of(family: str) -> str:
    """A coarse kind of kernel, for the summary table."""
    if family.endswith("_gemm"):
        return "gemm"
    if re.search(r"_pack_[ab]$", family):
        return "pack (im2col, transposes)"
    if family.endswith(("_unpack", "_accumulate")):
        return "unpack"
    if family.startswith("sgd_"):
        return "sgd update"
    if family.endswith("_shift"):
        return "compaction shift (max abs)"
    if family.endswith("_apply"):
        return "compaction apply (rounding)"
    if family.startswith("bn_"):
        return "batch-norm statistics"
    return "elementwise, pooling, head"


def kind_of(family: str, threads: int, elements: int) -> str:
    """How a non-GEMM kernel works: a reduction when each thread loops over elements (fewer
    than half as many threads as elements of its largest argument), else by what it does."""
    if 2 * threads <= elements:
        return "reduction"
    if family.endswith("_apply"):
        return "rounding"
    if re.search(r"_(pack_[ab]|unpack|accumulate)$", family):
        return "gather"
    return "elementwise"


def _shapes(manifest: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {k: (tuple(s), d) for k, (s, d) in manifest["buffers"].items()}
    for name, (base, shape, _) in manifest["views"].items():
        out[name] = (tuple(shape), manifest["buffers"][base][1])
    return out


def _elements(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def gemm_macs(args: list[tuple[tuple[int, ...], str]]) -> int:
    """g·M·Q·K of a GEMM kernel from its operands: C (g, M, Q) int32 and A (g, M, K) int8."""
    c = next(s for s, d in args if d == "int32" and len(s) == 3)
    a = next(s for s, d in args if d == "int8" and len(s) == 3 and s[:2] == c[:2])
    return _elements(c) * a[2]


def kernel_costs(manifest: dict[str, Any], model: Model = Model()) -> list[KernelCost]:
    """The cost of every kernel launch of a CUDA step manifest, in launch order."""
    shapes = _shapes(manifest)
    gemms = set(manifest.get("gemm_kernels", ()))
    out = []
    for i, (_, symbol, grid, block, args) in enumerate(manifest["kernels"]):
        touched = [shapes[a] for a in dict.fromkeys(args)]
        sizes = [(_elements(s) * ITEMSIZE[d], _elements(s), ITEMSIZE[d]) for s, d in touched]
        nbytes = sum(b for b, _, _ in sizes)
        _, largest, itemsize = max(sizes)
        blocks, per_block = _elements(grid), _elements(block)
        threads = blocks * per_block
        family = family_of(symbol)
        if symbol in gemms:
            kind, macs = "gemm", gemm_macs(touched)
            ops = 2 * macs
        else:
            kind, macs = kind_of(family, threads, largest), 0
            ops = model.ops(kind) * max(threads, largest)
        group = group_of(family)
        out.append(
            KernelCost(i, symbol, family, group, kind, nbytes, ops, threads, blocks, itemsize, macs)
        )
    return out


def kernel_time(
    cost: KernelCost, gpu: Gpu, model: Model = Model(), gemm: str = "imma", capped: bool = True
) -> tuple[float, str]:
    """Predicted seconds of one launch on `gpu` and what bounds it: "memory" (the bandwidth),
    "compute" (the datasheet peak: INT8 tensor cores for a GEMM, four MACs per INT32 lane for
    a dp4a GEMM, INT32 for the rest), or, with `capped`, "latency": too few bytes in flight to
    reach the bandwidth (Little's law, at least one round trip). `capped` also limits the
    compute peak to the SMs the launch can use. capped=False is the plain roofline."""
    t_bw = cost.bytes / gpu.hbm_bytes_s
    if cost.gemm:
        peak = gpu.int8_tensor_ops_s if gemm == "imma" else 4 * gpu.int32_ops_s
    else:
        peak = gpu.int32_ops_s
    if not capped:
        return max((t_bw, "memory"), (cost.ops / peak, "compute"))
    resident = min(cost.threads, gpu.sms * model.threads_per_sm)
    cap = model.gemm_bytes_in_flight if cost.gemm else model.loads_in_flight * cost.itemsize
    per_thread = min(float(cap), cost.bytes / max(cost.threads, 1))
    in_flight = max(resident * per_thread, 1.0)
    t_lat = model.mem_latency_s * max(1.0, cost.bytes / in_flight)
    if cost.gemm:  # one thread block per 64x64 tile of C: an SM per block at most
        share = min(1.0, cost.blocks / gpu.sms)
    else:
        share = min(1.0, resident / (gpu.sms * model.alu_threads_per_sm))
    return max((t_bw, "memory"), (t_lat, "latency"), (cost.ops / (peak * share), "compute"))


def step_time(times: Sequence[float], model: Model = Model(), graph: bool = True) -> float:
    """Device seconds of a step whose kernels take `times` in order. From a graph the kernels
    run back to back, `gap_s` apart; launched one by one, kernel i cannot start before the host
    has issued it (i + 1 launches of `host_launch_s`), so a run of short kernels is host-bound."""
    end = 0.0
    for i, t in enumerate(times):
        start = end + model.gap_s
        if not graph:
            start = max(start, (i + 1) * model.host_launch_s)
        end = start + t
    return end


@dataclass(frozen=True)
class Estimate:
    """A step's predicted time on one GPU: each kernel's, on the plain roofline (`peak_s`) and
    with the parallelism caps (`kernel_s`, bounded by `bound`), and the step's either way, from
    a CUDA graph and launched one by one."""

    gpu: Gpu
    peak_s: list[float]
    kernel_s: list[float]
    bound: list[str]
    peak_graph_s: float
    peak_no_graph_s: float
    graph_s: float
    no_graph_s: float


def estimate(
    costs: list[KernelCost], gpu: Gpu, model: Model = Model(), gemm: str = "imma"
) -> Estimate:
    peak = [kernel_time(c, gpu, model, gemm, capped=False)[0] for c in costs]
    timed = [kernel_time(c, gpu, model, gemm) for c in costs]
    times = [t for t, _ in timed]
    return Estimate(
        gpu,
        peak,
        times,
        [b for _, b in timed],
        step_time(peak, model, graph=True),
        step_time(peak, model, graph=False),
        step_time(times, model, graph=True),
        step_time(times, model, graph=False),
    )
