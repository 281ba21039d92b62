"""Product kernels compiled by TVM for the host CPU (`llvm`), callable on numpy int8 arrays.

Schedule (any product of te_products): the output's last axis is split by the int32 vector width
of the host and vectorized, the other output axes are fused and run in parallel, the whole
reduction sits between them, and the accumulator tile lives in registers (`local`). These are
the standalone product kernels of tests and research; the training step's GEMMs are
lowering/cpu_gemm's (byte products where HostCpu.gemm_kernel says so).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import s_tir, tirx

from mexc.lowering.te_products import Param, acc_block, params
from mexc.lowering.x86_int8 import COLUMNS


@dataclass(frozen=True)
class HostCpu:
    """What the schedules need to know about the host CPU."""

    arch: str  # "x86_64" | "aarch64" | ...
    features: frozenset[str]

    @property
    def vnni(self) -> bool:
        return "avx512_vnni" in self.features or "avx512vnni" in self.features

    @property
    def lanes32(self) -> int:
        """int32 lanes of one vector register."""
        if "avx512bw" in self.features:
            return 16
        if "avx2" in self.features:
            return 8
        return 4

    @property
    def vnni256(self) -> bool:
        """`vpdpbusd` on 256-bit registers: AVX-512 VNNI with VL, or AVX-VNNI."""
        return (self.vnni and "avx512vl" in self.features) or "avx_vnni" in self.features

    @property
    def gemm_kernel(self) -> str:
        """cpu_gemm's kernel for this host: byte products on x86 hosts with AVX2, with
        `vpdpbusd` where the host has it (both measured, docs/cpu.md); the int32 tile
        elsewhere."""
        if self.arch != "x86_64" or "avx2" not in self.features:
            return "int32"
        return "vnni_i8" if self.vnni256 else "avx2_i8"

    @property
    def gemm_lanes(self) -> int:
        """int32 lanes of the GEMM tile's vectors: the byte kernels work on 256-bit panels
        (x86_int8.COLUMNS), also on AVX-512 hosts."""
        return COLUMNS if self.gemm_kernel != "int32" else self.lanes32

    def target(self) -> tvm.target.Target:
        attrs: list[str] = []
        if self.arch == "x86_64":
            for flag, attr in [
                ("sse4_2", "+sse4.2"),
                ("avx2", "+avx2"),
                ("fma", "+fma"),
                ("avx512f", "+avx512f"),
                ("avx512bw", "+avx512bw"),
                ("avx512vl", "+avx512vl"),
            ]:
                if flag in self.features:
                    attrs.append(attr)
            if "avx2" in self.features:
                # LLVM's generic x86 tuning takes vector gathers to be slow, so it left every
                # table lookup (GELU, softmax's exp, sigmoid) scalar; with gathers a GELU over
                # 3136 x 768 took 1.32 ms instead of 3.88 on a 2-core Zen 3 (2026-12-02)
                attrs.append("+fast-gather")
            if self.vnni:
                attrs.append("+avx512vnni")
            if "avx_vnni" in self.features:
                attrs.append("+avxvnni")
        elif self.arch == "aarch64":
            attrs.append("+neon")
            if "asimddp" in self.features:
                attrs.append("+dotprod")
        spec: dict[str, object] = {"kind": "llvm"}
        if attrs:
            spec["mattr"] = attrs
        if self.arch == "aarch64":
            spec["mtriple"] = "aarch64-linux-gnu"
        return tvm.target.Target(spec)


def parse_cpuinfo(text: str, arch: str) -> HostCpu:
    """HostCpu from the text of /proc/cpuinfo (first processor's `flags` / `Features`)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return HostCpu(arch, frozenset(value.split()))
    return HostCpu(arch, frozenset())


@functools.cache
def host_cpu() -> HostCpu:
    arch = platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, arch)


def schedule_cpu(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc:
    """Parallel over the outer output axes, `lanes`-wide vector over the last one, reduction in
    between, accumulator tile in registers."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock(acc_block(func))
    out_shape = [int(d) for d in func.params[-1].shape]
    loops = sch.get_loops(blk)
    spatial, reduce = loops[: len(out_shape)], loops[len(out_shape) :]
    last = out_shape[-1]
    vec = lanes if last % lanes == 0 else (lanes // 2 if last % (lanes // 2) == 0 else 1)
    if vec > 1:
        outer_last, inner = sch.split(spatial[-1], [None, vec])
    else:
        outer_last, inner = spatial[-1], None
    outer = sch.fuse(*spatial[:-1], outer_last) if len(spatial) > 1 else outer_last
    if inner is not None:
        sch.reorder(outer, *reduce, inner)
    acc = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(acc, outer)
    sch.parallel(outer)
    if inner is not None:
        sch.vectorize(inner)
        cw_loops = sch.get_loops(acc)
        sch.vectorize(cw_loops[-1])
    sch.decompose_reduction(blk, reduce[0])
    return sch.mod["main"]


@dataclass
class CompiledProduct:
    """A product compiled for the host; call with the two int8 inputs, get the int32 output."""

    name: str
    inputs: tuple[Param, Param]
    output: Param
    _fn: Callable[..., None]
    _dev: tvm.runtime.Device

    def __call__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        for arr, p in zip((a, b), self.inputs):
            if arr.dtype != np.int8 or tuple(arr.shape) != p.shape:
                raise ValueError(
                    f"{self.name}: {p.name} must be int8 {p.shape}, got {arr.dtype} {arr.shape}"
                )
        ta = tvm.runtime.tensor(np.ascontiguousarray(a), self._dev)
        tb = tvm.runtime.tensor(np.ascontiguousarray(b), self._dev)
        tout = tvm.runtime.empty(self.output.shape, "int32", self._dev)
        self._fn(ta, tb, tout)
        res = tout.numpy()
        if out is not None:
            out[...] = res
            return out
        return res


def compile_product(func: tirx.PrimFunc, cpu: HostCpu | None = None) -> CompiledProduct:
    """Schedule and compile one product PrimFunc (from te_products) for the host CPU."""
    cpu = cpu or host_cpu()
    name = str(func.attrs["global_symbol"])
    scheduled = schedule_cpu(func, cpu.lanes32).with_attr("global_symbol", name)
    ex = tvm.compile(tvm.IRModule({name: scheduled}), target=cpu.target())
    a, b, out = params(func)
    return CompiledProduct(name, (a, b), out, ex[name], tvm.cpu())
