"""target="cuda": the whole training step compiled ahead of time for an NVIDIA GPU (docs/cuda.md).

`build_step(prog, archs, out)` needs TVM and nvcc but no GPU. It lowers the program with the GPU
variant of the launch plan (`build_plan(..., device="gpu")`: every product as a padded GEMM form,
update kernels per parameter shape), schedules every distinct kernel (the GEMMs on int8 tensor
cores, `cuda_products.schedule_gemm_imma`, or with `__dp4a` under MEXC_CUDA_GEMM=dp4a; the rest
with `cuda_schedule.schedule_gpu`), turns TE intermediates into plan buffers, and writes the
artifact folder:

    step<i>.cu           TVM's CUDA source of the kernels, in parts lowered in parallel
    step<i>.<arch>.cubin nvcc -O3 for each of sm_80 / sm_90 (the runtime picks the GPU's)
    plan.json            buffers, views, constants, state / input / key names (as the llvm
                         backend's plan), the kernel list (symbol, grid, block, buffer args)
                         and a data-parallel worker's collectives between kernels
    program.mexc         a checkpoint (IR, options, optimizer, initial state, step)

`mexc.backends.cuda.program.load_cuda(out)` runs it with CuPy, without TVM or nvcc.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tvm import tirx

from mexc.backends.cuda.fuse import fuse_one_block_runs
from mexc.backends.cuda.nvcc import compile_cubin
from mexc.backends.cuda.products import GEMM_SCHEDULES, gemm_schedule
from mexc.backends.cuda.program import (
    ARCHS,
    FORMAT,
    PROGRAM_FILE,
    SHARED_PROGRAM,
    launch_args,
)
from mexc.backends.cuda.schedule import Kernel, lower_kernels, promote_scratch, schedule_gpu
from mexc.backends.kernel_cache import build_entry, entry_lock
from mexc.backends.plan_layout import plan_layout
from mexc.errors import UnsupportedOpError
from mexc.lowering.plan_core import HostLaunch, is_gemm
from mexc.lowering.step_plan import (
    Launch,
    build_inference_plan,
    build_plan,
    check_launch_args,
    distinct_kernels,
    plan_manifest,
)
from mexc.lowering.workers import forked_map, split_symbols
from mexc.program import Program


def _scheduler(scratch: dict[str, list[tuple[str, tuple, str]]], gemm: str) -> Any:
    def schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
        symbol = str(func.attrs["global_symbol"])
        func, scratch[symbol] = promote_scratch(func)
        if is_gemm(func):
            return GEMM_SCHEDULES[gemm](func)
        return schedule_gpu(func)

    return schedule


@dataclass(frozen=True)
class LoweredStep:
    """A training step lowered to CUDA source, before nvcc: the manifest without its modules
    (buffers, views, layout, the kernel list with grids and blocks, gemm_kernels, counts) and
    the CUDA source of every part."""

    manifest: dict[str, Any]
    sources: list[str]
    tvm_seconds: float


def lower_step(
    prog: Program,
    pack_budget: int | None = None,
    inference: bool = False,
    lean: Mapping[int, int] | None = None,
) -> LoweredStep:
    """`prog`'s step (or inference plan) lowered by TVM to CUDA source and a launch list; needs
    TVM, not nvcc. `pack_budget`, `lean`: build_plan's."""
    t0 = time.perf_counter()
    if inference:
        plan = build_inference_plan(prog, device="gpu", pack_budget=pack_budget)
    else:
        plan = build_plan(prog, device="gpu", pack_budget=pack_budget, lean=lean)
    check_launch_args(plan)  # a kernel takes raw pointers: the buffers must fit its parameters
    scratch: dict[str, list[tuple[str, tuple, str]]] = {}
    gemm = gemm_schedule()
    funcs, alias = distinct_kernels(plan, _scheduler(scratch, gemm))
    parts = _lower_parts(funcs)
    manifest: dict[str, Any] = {"format": FORMAT, "gemm": gemm, **plan_manifest(plan)}
    module_of = {symbol: i for i, (_, kernels) in enumerate(parts) for symbol in kernels}
    kernels_of = {symbol: ks for _, kernels in parts for symbol, ks in kernels.items()}
    kernels, collectives, scratch_buffers = _kernel_list(
        plan.launches, funcs, alias, scratch, kernels_of, module_of
    )
    manifest["buffers"].update(scratch_buffers)
    manifest["gemm_kernels"] = sorted(
        k.symbol for symbol, func in funcs.items() if is_gemm(func) for k in kernels_of[symbol]
    )
    # runs of one-block kernels launch as one (fuse.py); the buffers of a fused kernel are
    # live together (the runtime checks the layout against its kernels' arguments)
    sources = [src for src, _ in parts]
    unfused = set(manifest["gemm_kernels"])
    manifest["kernels"], manifest["collectives"], sources = fuse_one_block_runs(
        kernels, collectives, sources, unfused
    )
    manifest["layout"] = plan_layout(manifest, launch_args(manifest))
    manifest["counts"] = {
        "plan_launches": len(plan.launches),
        "distinct_funcs": len(funcs),
        "kernels_before_fusion": len(kernels),
    }
    return LoweredStep(manifest, sources, time.perf_counter() - t0)


def build_step(
    prog: Program,
    archs: str | tuple[str, ...],
    out_dir: str | Path,
    pack_budget: int | None = None,
    inference: bool = False,
    lean: Mapping[int, int] | None = None,
    eval_plan: bool = False,
    program_file: str = PROGRAM_FILE,
    cubins: bool = True,
) -> dict[str, Any]:
    """Write the CUDA artifact of `prog`'s training step for `archs` (one or several of
    ARCHS: TVM's source does not depend on the architecture, so one lowering serves all) into
    `out_dir`; returns the manifest (also in plan.json). `pack_budget`, `lean`: build_plan's.
    inference=True: the artifact of the inference plan instead (step_plan.build_inference_plan;
    its manifest has "logits", its state is the eval path's parameters and statistics).
    eval_plan=True: the inference plan's artifact too, in the subfolder INFERENCE_DIR, which
    CudaProgram runs for predict / evaluate / logits on the step's state (manifest
    "inference": the subfolder; None with "inference_missing" saying why where the plan has an
    op without an eval-mode lowering, or the program is a data-parallel worker's).
    `program_file`: SHARED_PROGRAM for that subfolder, which names the training artifact's
    program file instead of writing a copy of it. cubins=False: the CUDA sources only, no nvcc
    (what the CPU emulator runs; a GPU cannot load such an artifact)."""
    archs = (archs,) if isinstance(archs, str) else tuple(archs)
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        raise ValueError(f"archs {list(archs)}: each must be one of {ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lowered = lower_step(prog, pack_budget, inference, lean)
    manifest = {**lowered.manifest, "archs": list(archs) if cubins else []}
    if not cubins:
        manifest["sources_only"] = True
    t1 = time.perf_counter()
    manifest["modules"] = _compile_modules(lowered.sources, archs if cubins else (), out)
    manifest["seconds"] = {
        "tvm": round(lowered.tvm_seconds, 2),
        "nvcc": round(time.perf_counter() - t1, 2),
    }
    if program_file == PROGRAM_FILE:
        opts = replace(prog.options, target="cuda")
        as_cuda = Program(prog.graph, prog.state, opts, prog.optimizer, prog.step_count)
        as_cuda.save(out / PROGRAM_FILE)
    else:  # the training artifact's, one folder up
        manifest["program_file"] = program_file
    manifest["program_sha256"] = hashlib.sha256((out / program_file).read_bytes()).hexdigest()
    if eval_plan and not inference:
        manifest |= _eval_artifact(prog, archs, out, pack_budget)
    (out / "plan.json").write_text(json.dumps(manifest))
    return manifest


# the subfolder of a training artifact that holds its inference plan's artifact
INFERENCE_DIR = "inference"


def _eval_artifact(
    prog: Program, archs: tuple[str, ...], out: Path, pack_budget: int | None
) -> dict[str, Any]:
    """The manifest entries of the inference artifact built beside a training step's."""
    if prog.workers is not None:  # a worker's predict runs the reference on whole batches
        return {"inference": None, "inference_missing": "a data-parallel worker's program"}
    try:
        folder = out / INFERENCE_DIR
        build_step(prog, archs, folder, pack_budget, inference=True, program_file=SHARED_PROGRAM)
    except UnsupportedOpError as err:  # predict runs the reference's inference path: exact too
        return {"inference": None, "inference_missing": str(err)}
    return {"inference": INFERENCE_DIR}


def device_layout(prog: Program, pack_budget: int | None = None) -> dict[str, Any]:
    """The device memory layout a CUDA artifact of `prog` would get (plan_layout: the state
    region and the arena, every kernel's global scratch per launch), lowered by TVM without
    nvcc: what bench/memory.py reports where no artifact is built. The kernels' fusion
    (fuse.py) keeps a fused run's buffers apart, so the lowering decides it. Equal to
    build_step's manifest["layout"] for the same program and budget."""
    return lower_step(prog, pack_budget).manifest["layout"]


def _lower_part(symbols: list[str], shared: dict[str, Any]) -> tuple[str, dict]:
    return lower_kernels({s: shared["funcs"][s] for s in symbols}, ARCHS[0])


def _lower_parts(funcs: dict[str, tirx.PrimFunc]) -> list[tuple[str, dict[str, list[Kernel]]]]:
    """TVM's CUDA lowering split over worker processes: one source and kernel table per part
    (the source does not depend on the architecture: ARCHS[0] stands for all)."""
    return forked_map(_lower_part, split_symbols(list(funcs), per_worker=16), {"funcs": funcs})


def _compile_modules(sources: list[str], archs: tuple[str, ...], out: Path) -> list[dict[str, Any]]:
    """step<i>.cu and nvcc's step<i>.<arch>.cubin for every part and architecture (nvcc runs
    as parallel processes)."""
    modules: list[dict[str, Any]] = []
    jobs = []
    for i, source in enumerate(sources):
        cu = out / f"step{i}.cu"
        cu.write_text(source)
        modules.append({"source": cu.name, "cubins": {}})
        jobs += [(i, arch, cu, out / f"step{i}.{arch}.cubin") for arch in archs]
    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        done = pool.map(lambda j: (j[0], j[1], compile_cubin(j[2], j[1], j[3])), jobs)
        for i, arch, cubin in done:
            sha = hashlib.sha256(cubin.read_bytes()).hexdigest()
            modules[i]["cubins"][arch] = {"file": cubin.name, "sha256": sha}
    return modules


def _scratch_name(launch: int, name: str) -> str:
    """The plan buffer of a kernel's global intermediate `name` at launch `launch`: live only
    during that launch, so the layout lets every other buffer reuse its bytes."""
    return f"scratch:{launch}.{name}"


def _kernel_list(
    launches: list[Launch | HostLaunch],
    funcs: dict,
    alias: dict[str, str],
    scratch: dict,
    kernels_of: dict,
    module_of: dict[str, int],
) -> tuple[list[list[Any]], list[list[Any]], dict[str, list[Any]]]:
    """[module, symbol, grid, block, [plan buffer per kernel parameter]] for every kernel of
    the step, in launch order; a data-parallel worker's collectives, [position, kind,
    buffer] (the host runs it on the int32 buffer after the first `position` kernels;
    plan_runtime.HOST_KINDS); and every launch's scratch buffer (its kernels' global
    intermediates, _scratch_name) as the manifest's buffers hold it, [shape, dtype]."""
    out: list[list[Any]] = []
    collectives: list[list[Any]] = []
    buffers: dict[str, list[Any]] = {}
    kernel = 0
    for launch in launches:
        if isinstance(launch, HostLaunch):
            collectives.append([len(out), launch.kind, launch.args[0]])
            continue
        symbol = alias[launch.symbol]
        # the implementing kernel's own parameter names (an aliased launch's func is equal up
        # to names), positionally bound to this launch's buffers
        names = [str(p.name) for p in funcs[symbol].params][: len(launch.args)]
        buffer_of = dict(zip(names, launch.args))
        for n, shape, dtype in scratch[symbol]:
            buffer_of[n] = _scratch_name(kernel, n)
            buffers[buffer_of[n]] = [list(shape), dtype]
        for k in kernels_of[symbol]:
            missing = [p for p in k.params if p not in buffer_of]
            if missing:
                raise ValueError(f"kernel {k.symbol}: parameters {missing} are not plan buffers")
            args = [buffer_of[p] for p in k.params]
            out.append([module_of[symbol], k.symbol, list(k.grid), list(k.block), args])
        kernel += 1
    return out, collectives, buffers


def cached_artifact(prog: Program, archs: tuple[str, ...] = ARCHS, eval_plan: bool = True) -> Path:
    """The artifact folder of `prog`'s step in the kernel cache (built when absent). Its
    program file holds the state of the first build; callers bring their own state.
    eval_plan: with the inference artifact (build_step), which the emulator does not run."""
    from mexc.backends.llvm.step import CACHE, cache_key

    what = f"cuda {','.join(archs)} gemm={gemm_schedule()}" + (" eval" if eval_plan else "")
    folder = CACHE / f"cuda-{cache_key(prog, what)}"
    with entry_lock(folder):  # a data-parallel job's workers build it once
        if (folder / "plan.json").exists():
            return folder

        def build(tmp: Path) -> None:
            build_step(prog, archs, tmp, eval_plan=eval_plan)

        return build_entry(folder, build)
