"""target="llvm": the whole training step compiled by TVM for the host CPU (docs/cpu.md).

`build_plan` turns the program into TIR kernels over named buffers; this module schedules them
for the host (products: parallel outer axes, vectorized last axis, register accumulators; the
rest as TVM lowers them), compiles them into one module, caches the compiled library on disk,
allocates every buffer once, and runs the launch list per step. Python hands over the quantized
batch, the labels, the learning rate pair and the stream keys; the state never leaves the
buffers except when it is read (state_dict, checksum, checkpoints, evaluation).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from mexc.codegen.cpu_gemm import schedule_parallel
from mexc.codegen.step_plan import StepPlan, build_plan
from mexc.codegen.tvm_llvm_products import HostCpu, host_cpu
from mexc.kernels import quantize
from mexc.kernels.loss import ce_loss
from mexc.mx import MX
from mexc.numerics import stream_keys
from mexc.program import Program

# TVM sizes its thread pool at hardware_concurrency / 2 on x86 (it assumes two hyperthreads per
# core), which is one thread on a two-core machine without SMT. Use every CPU this process may
# run on unless the user chose (TVM_NUM_THREADS); read when the pool starts, at the first step.
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
CACHE = Path(os.environ.get("MEXC_CACHE_DIR", Path(tempfile.gettempdir()) / "mexc-cache"))
_CODEGEN_SOURCES = (
    "step_plan.py",
    "tvm_llvm_step.py",
    "tvm_llvm_products.py",
    "cpu_gemm.py",
    "gemm_forms.py",
    "te_ops.py",
    "te_products.py",
    "te_compaction.py",
    "te_update.py",
    "te_divide.py",
)


def _cache_key(prog: Program, target: tvm.target.Target) -> str:
    """Hash of what the compiled code depends on: the program IR (shapes, attributes, rounding
    sites), the options and optimizer constants, the target, TVM, and the lowering code."""
    h = hashlib.sha256()
    for part in (prog.ir, repr(prog.options), repr(prog.optimizer), str(target), tvm.__version__):
        h.update(part.encode())
    here = Path(__file__).parent
    for src in _CODEGEN_SOURCES:
        h.update((here / src).read_bytes())
    return h.hexdigest()[:24]


def _lower(plan: StepPlan) -> tvm.IRModule:
    """Every launch's PrimFunc, the non-product ones given the generic parallel schedule (the
    GEMM kernels come scheduled from cpu_gemm and are left as they are)."""
    return tvm.IRModule(
        {
            launch.symbol: schedule_parallel(launch.func).with_attr(
                "global_symbol", launch.symbol
            )
            for launch in plan.launches
        }
    )


def compile_plan(prog: Program, plan: StepPlan, cpu: HostCpu | None = None) -> tvm.runtime.Module:
    """The compiled module of `plan`, from the on-disk cache when the same program was built."""
    cpu = cpu or host_cpu()
    target = cpu.target()
    lib = CACHE / f"llvm-{_cache_key(prog, target)}.so"
    if lib.exists():
        return tvm.runtime.load_module(str(lib))
    ex = tvm.compile(_lower(plan), target=target)
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp.so")
    ex.export_library(str(tmp))
    os.replace(tmp, lib)
    return tvm.runtime.load_module(str(lib))


class _Buffers:
    """Every plan buffer allocated once on the host device, views and constants included."""

    def __init__(self, plan: StepPlan) -> None:
        dev = tvm.cpu()
        self.t: dict[str, Any] = {
            name: tvm.runtime.empty(shape, dtype, dev)
            for name, (shape, dtype) in plan.buffers.items()
        }
        for name, arr in plan.constants.items():
            self.t[name].copyfrom(arr)
        # zero-copy numpy windows on the host buffers (the step writes its inputs through them)
        self.np = {name: np.from_dlpack(t) for name, t in self.t.items()}
        for name, view in plan.views.items():
            size = int(np.prod(view.shape))
            flat = self.np[view.base].reshape(-1)[view.offset : view.offset + size]
            # through numpy, so the view's data pointer moves (kernels expect byte_offset 0)
            self.t[name] = tvm.runtime.from_dlpack(flat.reshape(view.shape))
            self.np[name] = flat.reshape(view.shape)


class LlvmProgram(Program):
    """A Program whose training step runs as TVM-compiled host code (same API, same bits)."""

    def __init__(self, prog: Program) -> None:
        self._step_plan = build_plan(prog, host_cpu().lanes32)
        self._module = compile_plan(prog, self._step_plan)
        self._bufs = _Buffers(self._step_plan)
        self._calls = [
            (self._module[launch.symbol], [self._bufs.t[a] for a in launch.args])
            for launch in self._step_plan.launches
        ]
        self._key_ids = np.asarray(self._step_plan.key_ids, np.int64)
        self._state_cache: dict[str, MX] | None = None
        super().__init__(prog.graph, prog.state, prog.options, prog.optimizer, prog.step_count)

    # the state lives in the plan's buffers; reading it copies it out
    @property  # type: ignore[override]
    def state(self) -> dict[str, MX]:
        if self._state_cache is None:
            out = {}
            for name, (m, e) in self._step_plan.state.items():
                shape = self._exp_shapes[name]
                out[name] = MX.of(self._bufs.np[m].copy(), self._bufs.np[e].reshape(shape).copy())
            self._state_cache = out
        return self._state_cache

    @state.setter
    def state(self, value: dict[str, MX]) -> None:
        self._exp_shapes = {name: tuple(v.e.shape) for name, v in value.items()}
        for name, (m, e) in self._step_plan.state.items():
            self._bufs.np[m][...] = value[name].m
            self._bufs.np[e][...] = np.asarray(value[name].e, np.int64).reshape(-1)
        self._state_cache = None

    def step(self, x: Any, y: Any) -> float:
        xs = self._check_x(x, exact_batch=True)
        ys = self._check_y(y, self.batch)
        plan, np_bufs = self._step_plan, self._bufs.np
        q = quantize(xs, self.options.bits)  # the float boundary, on the host
        np_bufs[plan.input[0]][...] = q.m
        np_bufs[plan.input[1]][0] = int(q.e)
        np_bufs[plan.labels][...] = ys
        if plan.valid:
            np_bufs[plan.valid][0] = self.batch
        lr = self.lr_at(self.step_count)
        np_bufs[plan.lr][...] = (lr.num, lr.shift)
        np_bufs[plan.keys][: self._key_ids.size] = stream_keys(
            self.options.seed, self.step_count, self._key_ids
        )
        for fn, args in self._calls:
            fn(*args)
        self._state_cache = None
        self.step_count += 1
        return ce_loss(np_bufs[plan.probs], ys, self.batch)
