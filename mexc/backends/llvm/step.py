"""target="llvm": the whole training step compiled by TVM for the host CPU (docs/cpu.md).

`build_plan` turns the program into TIR kernels over named buffers; this module schedules them
for the host (products: parallel outer axes, vectorized last axis, register accumulators; the
rest as TVM lowers them), compiles those the kernel store lacks (kernel_store.py), caches the
plan on disk, allocates every buffer once, and runs the launch list per step. Python hands over
the quantized batch, the labels, the learning rate pair and the stream keys; the state never
leaves the buffers except when it is read (state_dict, checksum, checkpoints, evaluation).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from mexc.backends.kernel_cache import CACHE, build_entry, entry_lock, sources_digest
from mexc.backends.llvm.kernel_store import KernelStore
from mexc.backends.llvm.products import HostCpu, host_cpu
from mexc.backends.plan_layout import (
    ALIGN,
    POISON,
    carve,
    carve_separate,
    check_layout,
    nbytes,
    plan_layout,
    region_bytes,
    separate_bytes,
)
from mexc.backends.plan_runtime import (
    PlanProgram,
    host_collective,
    inference_keys,
    is_host,
    share_state,
    state_buffers,
    window,
)
from mexc.errors import UnsupportedOpError
from mexc.lowering.cpu_gemm import schedule_parallel
from mexc.lowering.step_plan import (
    StepPlan,
    build_inference_plan,
    build_plan,
    check_launch_args,
    distinct_kernels,
    plan_manifest,
)
from mexc.program import Program

# TVM sizes its thread pool at hardware_concurrency / 2 on x86 (it assumes two hyperthreads per
# core), which is one thread on a two-core machine without SMT. Use every CPU this process may
# run on unless the user chose (TVM_NUM_THREADS); read when the pool starts, at the first step.
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
MANIFEST_FORMAT = "mexc-llvm-plan-4"  # 4: key_rows, host collectives, valid int32[2]
_MEXC = Path(__file__).resolve().parents[2]


def _lowering_sources() -> list[Path]:
    """Every source the compiled kernels depend on: the codegen, and the numerics and kernel
    constants it imports (tables, caps, rounding sites). Not float_check.py: it reads the
    compiled libraries and changes nothing in them."""
    llvm = [p for p in (_MEXC / "backends" / "llvm").glob("*.py") if p.name != "float_check.py"]
    return sorted(
        [
            *(_MEXC / "lowering").glob("*.py"),
            *(_MEXC / "backends").glob("*.py"),
            *llvm,
            *(_MEXC / "backends" / "cuda").glob("*.py"),
            *(_MEXC / "ops").glob("*.py"),
            _MEXC / "numerics.py",
            _MEXC / "mx.py",
            _MEXC / "arena.py",
            *(_MEXC / "kernels").glob("*.py"),
        ]
    )


_LOWERING_DIGEST = sources_digest(_lowering_sources())  # as imported (sources_digest)


def _lowering_digest() -> str:
    """Hash of the lowering code the compiled kernels depend on (_lowering_sources)."""
    return _LOWERING_DIGEST


def cache_key(prog: Program, target: str) -> str:
    """Hash of what the compiled code depends on: the program IR (shapes, attributes, rounding
    sites), bits / rounding / velocity grouping, the optimizer's static constants (SGD's
    momentum and weight decay, AdamW's betas), the target, TVM, and the lowering code. Not the
    seed, the step or the learning-rate schedule: they reach the kernels as run-time keys and
    scalars."""
    o, opt = prog.options, prog.optimizer
    h = hashlib.sha256()
    fixed = (o.bits, o.rounding, o.per_group_velocity, *opt.static_constants())
    for part in (prog.ir, repr(fixed), target, tvm.__version__, _lowering_digest()):
        h.update(part.encode())
    return h.hexdigest()[:24]


@dataclass
class Compiled:
    """The loaded kernels and the plan's launch list in a form that needs no TE: what the cache
    stores (plan.json; the kernels themselves are in the kernel store)."""

    modules: dict[str, Any]  # part file name -> loaded module
    manifest: dict[str, Any]
    libraries: list[Path] = field(default_factory=list)  # the shared libraries (float_check)

    def function(self, symbol: str) -> Any:
        part, name = self.manifest["kernels"][symbol]
        return self.modules[part].get_function(name, True)


def _manifest(plan: StepPlan, alias: dict[str, str]) -> dict[str, Any]:
    launches = [[alias.get(x.symbol, x.symbol), list(x.args)] for x in plan.launches]
    manifest = {"format": MANIFEST_FORMAT, **plan_manifest(plan), "launches": launches}
    manifest["layout"] = plan_layout(manifest, [args for _, args in launches])
    return manifest


def compile_program(
    prog: Program,
    cpu: HostCpu | None = None,
    plan_device: str = "cpu",
    pack_budget: int | None = None,
    inference: bool = False,
    lean: Mapping[int, int] | None = None,
) -> Compiled:
    """The compiled training step of `prog`, from the on-disk cache when the same program (IR,
    options, target, TVM and lowering code) was built before; the cache skips TE and TVM.
    plan_device="gpu" runs the GPU variant of the launch plan on the host (its GEMM forms and
    per-shape update kernels): the host twin that checks the CUDA plan bit for bit.
    inference=True: the inference plan instead (step_plan.build_inference_plan)."""
    cpu = cpu or host_cpu()
    target = cpu.target()
    what = f"{target} plan={plan_device} gemm={cpu.gemm_kernel} packs={pack_budget}"
    what += f" lean={sorted(lean.items())}" if lean is not None else ""
    what += " inference" if inference else ""
    folder = CACHE / f"llvm-{cache_key(prog, what)}"
    with entry_lock(folder):
        return _compiled(prog, cpu, plan_device, pack_budget, inference, lean, folder)


def _compiled(
    prog: Program,
    cpu: HostCpu,
    plan_device: str,
    pack_budget: int | None,
    inference: bool,
    lean: Mapping[int, int] | None,
    folder: Path,
) -> Compiled:
    """compile_program's entry `folder`, loaded, or built where it is missing or damaged."""
    target = cpu.target()
    if (folder / "plan.json").exists():
        try:
            return _load(folder)
        except Exception as err:  # noqa: BLE001 - any unreadable entry is rebuilt, not trusted
            print(f"mexc: rebuilding the damaged cache entry {folder} ({err})", file=sys.stderr)
            shutil.rmtree(folder, ignore_errors=True)
    if inference:
        plan = build_inference_plan(prog, cpu.gemm_lanes, plan_device, cpu.gemm_kernel, pack_budget)
    else:
        plan = build_plan(prog, cpu.gemm_lanes, plan_device, cpu.gemm_kernel, pack_budget, lean)
    check_launch_args(plan)  # the kernels do not check their arguments (kernel_store)
    # the GEMM kernels come scheduled from cpu_gemm; the rest get the generic schedule
    funcs, alias = distinct_kernels(plan, schedule_parallel)
    salt = f"{target} {tvm.__version__} {_lowering_digest()}"
    kernels = KernelStore(CACHE).compile(funcs, target, salt)

    def build(tmp: Path) -> None:
        manifest = {**_manifest(plan, alias), "kernels": kernels}
        (tmp / "plan.json").write_text(json.dumps(manifest))

    return _load(build_entry(folder, build))


_LOADED: dict[Path, Any] = {}  # part -> its module: a process loads each part once


def _load(folder: Path) -> Compiled:
    manifest = json.loads((folder / "plan.json").read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"plan format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    check_layout(manifest, [args for _, args in manifest["launches"]])
    store = KernelStore(CACHE)
    modules: dict[str, Any] = {}
    damaged: list[str] = []
    for part in sorted({part for part, _ in manifest["kernels"].values()}):
        path = store.parts / part
        if path not in _LOADED:
            try:
                _LOADED[path] = tvm.runtime.load_module(str(path))
            except Exception as err:  # noqa: BLE001 - reported below, its kernels rebuilt
                store.forget(part)
                damaged.append(f"{part}: {str(err).splitlines()[0]}")
                continue
        modules[part] = _LOADED[path]
    if damaged:
        raise ValueError(f"kernel libraries that do not load: {'; '.join(damaged)}")
    compiled = Compiled(modules, manifest, [store.parts / p for p in modules])
    kernels = manifest["kernels"]
    missing = {
        s
        for s, _ in manifest["launches"]
        if not is_host(s) and not modules[kernels[s][0]].implements_function(kernels[s][1], True)
    }
    for symbol in sorted(missing):
        store.forget_kernel(kernels[symbol][1])  # compiled again on the rebuild
    if missing:
        raise ValueError(f"kernels missing from their libraries: {', '.join(sorted(missing))}")
    return compiled


def aligned_bytes(size: int, fill: int) -> np.ndarray:
    """`size` bytes (uint8) starting at an ALIGN-byte boundary, every byte `fill`. Zeros come
    from calloc: a page nothing writes is never backed by memory (the inference plan's copy of
    the state region, whose state buffers are the training step's)."""
    raw = np.zeros(size + ALIGN, np.uint8) if fill == 0 else np.full(size + ALIGN, fill, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + size]


LAYOUTS = ("arena", "separate")


class _Buffers:
    """Every plan buffer on the host: views into one state region and one arena
    (plan_layout), or with layout="separate" one allocation per buffer (as before the layout
    existed: for A/B measurements and diagnosis). Constants are written once; views
    included."""

    def __init__(
        self,
        manifest: dict[str, Any],
        layout: str = "arena",
        shared: _Buffers | None = None,
    ) -> None:
        """shared: the buffers of another plan over the same state (the training step's, for
        the inference plan): its state buffers are used instead of this plan's own, and its
        arena too where it is large enough (the plans never run at the same time, and every
        launch writes the arena bytes it reads)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
        if layout == "arena":
            sizes = region_bytes(manifest)
            regions = {"state": aligned_bytes(sizes["state"], 0)}
            self.allocated = sizes["state"]
            other = shared.arena if shared is not None else None
            if other is not None and other.nbytes >= sizes["arena"]:
                regions["arena"] = other[: sizes["arena"]]
            if "arena" not in regions:
                regions["arena"] = aligned_bytes(sizes["arena"], POISON)
                self.allocated += sizes["arena"]
            self.arena: np.ndarray | None = regions["arena"]
            self.np = carve(manifest, regions, window)
        else:
            self.arena = None

            def allocate(name: str, shape: tuple[int, ...], dtype: str, fill: int) -> np.ndarray:
                return aligned_bytes(nbytes(shape, dtype), fill).view(dtype).reshape(shape)

            self.np = carve_separate(manifest, allocate, window)
            self.allocated = separate_bytes(manifest)
        if shared is not None:
            if layout == "arena":  # the state buffers are the shared plan's: not this one's
                self.allocated -= sum(self.np[name].nbytes for name in state_buffers(manifest))
            share_state(manifest, self.np, shared.np)
        for name, (dtype, values) in manifest["constants"].items():
            self.np[name][...] = np.asarray(values, np.dtype(dtype)).reshape(self.np[name].shape)
        # zero-copy TVM tensors over the numpy windows (kernels expect byte_offset 0)
        self.t: dict[str, Any] = {name: tvm.runtime.from_dlpack(a) for name, a in self.np.items()}


class LlvmProgram(PlanProgram):
    """A Program whose training step runs as TVM-compiled host code (same API, same bits)."""

    def __init__(
        self,
        prog: Program,
        plan_device: str = "cpu",
        cpu: HostCpu | None = None,
        layout: str = "arena",
        pack_budget: int | None = None,
        lean: Mapping[int, int] | None = None,
    ) -> None:
        compiled = compile_program(prog, cpu, plan_device, pack_budget, lean=lean)
        self._build = (cpu, plan_device, pack_budget, layout)
        self._inf: tuple[dict[str, Any], _Buffers, list[tuple[Any, list[Any]]]] | None = None
        # why predict runs the reference instead of an inference plan ("": it does not)
        self.inference_fallback = ""
        self.libraries = compiled.libraries
        self._bufs = _Buffers(compiled.manifest, layout)
        self.separate_buffers = layout == "separate"
        comm = prog.workers.comm if prog.workers is not None else None
        self._calls = [
            (host_collective(symbol, comm), [self._bufs.np[args[0]]])
            if is_host(symbol)
            else (compiled.function(symbol), [self._bufs.t[a] for a in args])
            for symbol, args in compiled.manifest["launches"]
        ]
        super().__init__(prog, compiled.manifest)

    def _write(self, name: str, values: np.ndarray) -> None:
        self._bufs.np[name].reshape(-1)[: values.size] = values.reshape(-1)

    def _read(self, name: str) -> np.ndarray:
        return self._bufs.np[name].copy()

    def _run(self) -> None:
        for fn, args in self._calls:
            fn(*args)

    def allocated_bytes(self) -> dict[str, int]:
        """The training step's state region and arena ("host"), and apart from them what the
        inference plan (predict, evaluate) allocated of its own once it ran ("eval_host": its
        per-call buffers, and its arena where the step's is too small for the evaluation
        batch)."""
        inference = self._inf[1].allocated if self._inf is not None else 0
        return {"host": self._bufs.allocated, "device": 0, "eval_host": inference}

    # the inference plan: compiled on first use (predict, evaluate, logits), over the training
    # step's state buffers (shared: no copy) and, where it fits, its arena
    def _inference_plan(self) -> dict[str, Any] | None:
        if self.inference_fallback:
            return None
        if self._inf is None:
            cpu, plan_device, pack_budget, layout = self._build
            try:
                source = self._inference_source()
                compiled = compile_program(source, cpu, plan_device, pack_budget, inference=True)
            except UnsupportedOpError as err:  # the reference's inference path: exact too
                self.inference_fallback = str(err)
                return None
            bufs = _Buffers(compiled.manifest, layout, shared=self._bufs)
            calls = [
                (compiled.function(symbol), [bufs.t[a] for a in args])
                for symbol, args in compiled.manifest["launches"]
            ]
            self._inf = (compiled.manifest, bufs, calls)
            keys = inference_keys(self.options.seed, compiled.manifest)
            bufs.np[compiled.manifest["keys"]][...] = keys
        return self._inf[0]

    def _infer_write(self, name: str, values: np.ndarray) -> None:
        assert self._inf is not None
        self._inf[1].np[name].reshape(-1)[: values.size] = values.reshape(-1)

    def _infer_read(self, name: str) -> np.ndarray:
        assert self._inf is not None
        return self._inf[1].np[name].copy()

    def _infer_run(self) -> None:
        assert self._inf is not None
        for fn, args in self._inf[2]:
            fn(*args)

    def kernel_times(self, x: Any, y: Any, repeats: int = 3) -> dict[str, float]:
        """Seconds per launch (best of `repeats` steps, each launch timed on its own), keyed by
        launch position and kernel symbol: where a step's time goes. Trains `repeats` steps."""
        best: dict[str, float] = {}
        for _ in range(repeats):
            self.step(x, y)  # sets the inputs of this step
            for i, ((fn, args), (symbol, _)) in enumerate(
                zip(self._calls, self._plan_json["launches"])
            ):
                t0 = time.perf_counter()
                fn(*args)
                key = f"{i:04d} {symbol}"
                best[key] = min(best.get(key, float("inf")), time.perf_counter() - t0)
        return best
