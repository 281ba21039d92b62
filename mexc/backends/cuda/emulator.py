"""Run a CUDA artifact's own kernel source on the CPU, to check the CUDA lowering without a GPU
(docs/cuda.md, "Emulated on the CPU").

The llvm twin (`LlvmProgram(prog, plan_device="gpu")`) runs the GPU plan's TIR on the host, but
not what TVM's CUDA schedules and code generator made of it: thread and block indexing, shared
memory staging, barriers, warp shuffles of the cross-thread reductions, WMMA tiles, the launch
extents and parameter binding that `cuda_step` extracted into plan.json. The emulator compiles
each step<i>.cu of an artifact with g++ against `emu.hpp` (CUDA built-ins, WMMA and dp4a
in plain integer C++, threads as fibers that switch at barriers) and runs plan.json's launch
list on numpy buffers: the same source, the same launches, the same bits a GPU must produce.

    python -m mexc.backends.cuda.emulator build/fashion --steps 2    # compares with the reference

Needs g++ (no TVM, nvcc, GPU or CuPy). Slow: meant for small batches.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mexc.backends.cuda.program import StepArtifact, refuse_without_workers, segments
from mexc.backends.cuda.source import kernel_bodies
from mexc.backends.plan_layout import POISON, carve, carve_separate, nbytes, region_bytes
from mexc.backends.plan_runtime import (
    PlanProgram,
    collective,
    inference_keys,
    share_state,
    state_buffers,
    window,
)
from mexc.errors import MexcError
from mexc.program import Program

HEADER = Path(__file__).with_name("emu.hpp")
# -Og: an LSTM step's module (6,700 lines) builds in 1.7 s against -O1's 3.1 s, and
# SmallResNet's step emulates in 0.8 s against 0.7 s (2026-12-07): most builds run two steps
CXX_FLAGS = (
    "-std=c++17",
    "-Og",
    "-fwrapv",
    "-fno-strict-aliasing",
    "-U_FORTIFY_SOURCE",
    "-shared",
    "-fPIC",
    "-w",
)
# a kernel with any of these needs its block's threads as fibers
SYNCING = re.compile(r"__syncthreads|__syncwarp|__shfl")
SHARED_ALIGNED = re.compile(r"__shared__ (alignas\(\d+\))")


class EmulatorError(MexcError):
    """The emulator could not build or run an artifact's kernels."""


def emulator_source(cuda_source: str) -> str:
    """TVM's CUDA source with its preamble (CUDA headers, intrinsics for nvcc) replaced by the
    emulator header."""
    first = cuda_source.find('extern "C"')
    if first < 0:
        raise EmulatorError("the CUDA source holds no kernel")
    if "__activemask" in cuda_source:
        # a GPU since Volta does not make __activemask() the lanes that reach a shuffle; the
        # emulator, always converged, would hide that (mexc.backends.cuda.source)
        raise EmulatorError(
            "the CUDA source takes a warp shuffle's mask from __activemask(), which a GPU does "
            "not guarantee; rebuild the artifact with this version of mexc"
        )
    body = SHARED_ALIGNED.sub(r"\1 static", cuda_source[first:])  # C++: alignas before static
    return f'#include "{HEADER.name}"\n' + body


def build_module(cuda_source: str, cache: Path | None = None) -> Path:
    """g++'s shared library of one module of TVM CUDA source, cached by the hash of the source,
    the emulator header and the flags. The workers of a data-parallel job need the same modules:
    one builds each while the others wait for it (kernel_cache.entry_lock)."""
    from mexc.backends.kernel_cache import CACHE, entry_lock

    text = emulator_source(cuda_source)
    digest = hashlib.sha256((text + HEADER.read_text() + " ".join(CXX_FLAGS)).encode())
    lib = (cache or CACHE / "cuda-emu") / f"{digest.hexdigest()[:24]}.so"
    if lib.exists():
        return lib
    with entry_lock(lib):
        if lib.exists():  # built by another process while this one waited
            return lib
        return _build_module(text, lib)


def _build_module(text: str, lib: Path) -> Path:
    """build_module's g++ run: `text` compiled to the shared library `lib`."""
    cxx = shutil.which("g++")
    if cxx is None:
        raise EmulatorError("the CUDA emulator needs g++ (apt-get install g++)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.with_suffix(f".{time.time_ns()}.cpp")
    src.write_text(text)
    tmp = src.with_suffix(".so.tmp")
    cmd = [cxx, *CXX_FLAGS, f"-I{HEADER.parent}", str(src), "-o", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    src.unlink()
    if run.returncode != 0:
        raise EmulatorError(f"g++ failed on the CUDA source:\n{run.stderr[-3000:]}")
    tmp.replace(lib)  # atomic: a concurrent build of the same module wins or loses whole
    return lib


# the emulator's fibers and error text are per process: one launch at a time (ctypes lets
# threads call in at once)
_LAUNCH_LOCK = threading.Lock()


class EmulatedModule:
    """The kernels of one CUDA source, built for the CPU; `launch` runs one of them over a grid
    on numpy arrays (every kernel parameter is a pointer). reverse=True runs the blocks, and the
    threads of each block between barriers, last to first: a kernel whose result depends on that
    order has a race a GPU may expose."""

    def __init__(self, cuda_source: str) -> None:
        self._lib = ctypes.CDLL(str(build_module(cuda_source)))
        self._lib.mexc_emu_launch.restype = ctypes.c_int
        self._lib.mexc_emu_error.restype = ctypes.c_char_p
        bodies = kernel_bodies(cuda_source)
        self.kernels = set(bodies)
        self._syncing = {name for name, body in bodies.items() if SYNCING.search(body)}

    def launcher(
        self, symbol: str, grid: Sequence[int], block: Sequence[int], args: Sequence[np.ndarray]
    ) -> Callable[[bool], None]:
        """A call that launches `symbol` on `args` (kept alive by the caller; their memory must
        not move) with the given order."""
        if symbol not in self.kernels:
            raise EmulatorError(f"kernel {symbol} is not in the module")
        lib = self._lib
        fn = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p)
        argv = (ctypes.c_void_p * max(1, len(args)))(*[a.ctypes.data for a in args])
        dims = (ctypes.c_int * 3)(*grid), (ctypes.c_int * 3)(*block)
        fibers, nargs = int(symbol in self._syncing), len(args)

        def launch(reverse: bool = False) -> None:
            with _LAUNCH_LOCK:
                if lib.mexc_emu_launch(fn, nargs, argv, dims[0], dims[1], fibers, int(reverse)):
                    raise EmulatorError(f"kernel {symbol}: {lib.mexc_emu_error().decode()}")

        return launch

    def launch(
        self,
        symbol: str,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[np.ndarray],
        reverse: bool = False,
    ) -> None:
        for a in args:
            if not a.flags.c_contiguous:
                raise EmulatorError(f"kernel {symbol}: arguments must be C-contiguous arrays")
        self.launcher(symbol, grid, block, args)(reverse)


class EmulatedCudaProgram(PlanProgram):
    """A CUDA artifact's training step with its kernels emulated on the CPU, every kernel of
    plan.json launched in order with its grid and block (reverse: see EmulatedModule).

    layout="arena" (default) places the buffers as the GPU runtime does, in the artifact's
    state region and arena (plan_layout), each region between guard bytes; layout="separate"
    gives every buffer an allocation of its own between guard bytes, which names the buffer a
    kernel wrote out of bounds. The guards of a kernel's regions or buffers are checked after
    it. A data-parallel worker's collectives run between the kernels, as on the GPU."""

    def __init__(
        self,
        artifact: StepArtifact,
        program: Program | None = None,
        reverse: bool = False,
        layout: str = "arena",
    ) -> None:
        if layout not in ("arena", "separate"):
            raise ValueError(f"layout {layout!r} is not 'arena' or 'separate'")
        man = artifact.manifest
        program = program or artifact.program
        refuse_without_workers(man, program, artifact.path)
        self.reverse = reverse
        self.separate_buffers = layout == "separate"
        self._t, self._raw = _allocate(man) if self.separate_buffers else _allocate_arena(man)
        self._guards = _guard_keys(man, self.separate_buffers)
        self._allocated = sum(int(r.nbytes) - 2 * GUARD for r in self._raw.values())
        modules = [
            EmulatedModule((artifact.path / entry["source"]).read_text())
            for entry in man["modules"]
        ]
        self._calls = [
            (
                symbol,
                modules[module].launcher(symbol, grid, block, [self._t[a] for a in args]),
                [(k, self._raw[k]) for k in sorted({self._guards[a] for a in args})],
            )
            for module, symbol, grid, block, args in man["kernels"]
        ]
        comm = program.workers.comm if program.workers is not None else None
        self._segments = [
            (
                self._calls[run.start : run.stop],
                [(collective(kind, comm), self._t[name]) for kind, name in after],
            )
            for run, after in segments(man)
        ]
        self.artifact = artifact
        self._inf: _EmulatedInference | None = None  # the artifact's inference/, on first use
        super().__init__(program, man)

    def allocated_bytes(self) -> dict[str, int]:
        """The device bytes the GPU runtime would allocate (guards not counted)."""
        return {"host": 0, "device": self._allocated}

    def _write(self, name: str, values: np.ndarray) -> None:
        _fill(self._t[name], values)

    def _read(self, name: str) -> np.ndarray:
        return self._t[name].copy()

    # logits / predict / evaluate: an inference artifact (build_step(..., inference=True)) runs
    # its own kernels on the state set on this program (its plan holds no training step); a
    # training artifact with an inference artifact beside it (build_step's eval_plan, the
    # CLI's) runs that one's kernels on this step's state buffers, as CudaProgram does
    def _inference_plan(self) -> dict[str, Any] | None:
        if "logits" in self.plan:
            return self.plan
        folder = self.plan.get("inference")
        if not folder or self.workers is not None:
            return None
        if self._inf is None:
            inference = StepArtifact.load(self.artifact.path / folder, sources=True)
            self._inf = _EmulatedInference(self, inference)
        return self._inf.manifest

    def _infer_write(self, name: str, values: np.ndarray) -> None:
        _fill((self._t if self._inf is None else self._inf.t)[name], values)

    def _infer_read(self, name: str) -> np.ndarray:
        return self._read(name) if self._inf is None else self._inf.t[name].copy()

    def _infer_run(self) -> None:
        if self._inf is None:
            return self._run()
        _launch_checked(self._inf.calls, self.reverse)

    def _run(self) -> None:
        for calls, collectives in self._segments:
            _launch_checked(calls, self.reverse)
            for run, buf in collectives:
                run(buf)


def _fill(buffer: np.ndarray, values: np.ndarray) -> None:
    """Copy `values` into the start of `buffer`."""
    buffer.reshape(-1)[: values.size] = np.ascontiguousarray(values).reshape(-1)


def _guard_keys(man: dict[str, Any], separate: bool) -> dict[str, str]:
    """Plan name -> the guarded allocation it lives in: its buffer (separate allocations), or
    its buffer's region."""
    base_of = {name: base for name, (base, _, _) in man["views"].items()}
    region_of = {name: r for name, (r, _) in man["layout"]["offsets"].items()}
    names = [*man["buffers"], *man["views"]]
    return {n: base_of.get(n, n) if separate else region_of[base_of.get(n, n)] for n in names}


def _launch_checked(calls: list[tuple[str, Any, list]], reverse: bool) -> None:
    """Run each (symbol, launch, [(allocation, its guarded bytes)]) in order, and raise once a
    kernel has written over the guards of an allocation it was given."""
    for symbol, launch, guarded in calls:
        launch(reverse)
        broken = [key for key, raw in guarded if not guards_intact(raw)]
        if broken:
            raise EmulatorError(f"kernel {symbol} wrote outside {broken}")


class _EmulatedInference:
    """A training artifact's inference artifact, emulated over the step's state buffers (no
    copy, as CudaProgram._load_inference binds them) and an arena of its own: poisoned, so
    that a kernel reading arena bytes no kernel of the plan wrote shows."""

    def __init__(self, step: EmulatedCudaProgram, art: StepArtifact) -> None:
        man = art.manifest
        self.manifest, self.path = man, art.path
        self.t, raw = _allocate_arena(man)
        share_state(man, self.t, step._t)
        own = _guard_keys(man, separate=False)
        state = state_buffers(man)
        base_of = {name: base for name, (base, _, _) in man["views"].items()}

        def guard(name: str) -> tuple[str, np.ndarray]:  # the step's allocation, or its own
            base = base_of.get(name, name)
            if base in state:
                key = step._guards[base]
                return f"the step's {key}", step._raw[key]
            return own[name], raw[own[name]]

        _fill(self.t[man["keys"]], inference_keys(step.options.seed, man))
        modules = [EmulatedModule((art.path / e["source"]).read_text()) for e in man["modules"]]
        self.calls = [
            (
                symbol,
                modules[module].launcher(symbol, grid, block, [self.t[a] for a in args]),
                sorted(dict(guard(a) for a in args).items()),
            )
            for module, symbol, grid, block, args in man["kernels"]
        ]


GUARD = 256  # bytes of a known pattern before and after every buffer
GUARD_BYTE = 0xA5


def _guarded(nbytes: int, fill: int) -> np.ndarray:
    """`nbytes` bytes of `fill` between GUARD bytes of GUARD_BYTE, 64-byte aligned inside."""
    raw = np.full(nbytes + 2 * GUARD + 64, GUARD_BYTE, np.uint8)
    start = -(raw.ctypes.data + GUARD) % 64
    raw = raw[start : start + nbytes + 2 * GUARD]
    raw[GUARD : GUARD + nbytes] = fill
    return raw


def _allocate_arena(man: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The artifact's two regions as the GPU runtime allocates them (state zeroed, arena
    poisoned), each between guards; buffers and views carved from them, constants written."""
    raw = {k: _guarded(v, POISON if k == "arena" else 0) for k, v in region_bytes(man).items()}
    regions = {k: r[GUARD : r.size - GUARD] for k, r in raw.items()}
    t = carve(man, regions, window)
    for name, (dtype, values) in man["constants"].items():
        t[name][...] = np.asarray(values, np.dtype(dtype)).reshape(t[name].shape)
    return t, raw


def _allocate(man: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One guarded allocation per buffer (arena buffers of the layout poisoned, the rest
    zeroed), constants, and views that share their base's memory; and per buffer its raw
    allocation."""
    raw: dict[str, np.ndarray] = {}

    def allocate(name: str, shape: tuple[int, ...], dtype: str, fill: int) -> np.ndarray:
        r = raw[name] = _guarded(nbytes(shape, dtype), fill)
        return r[GUARD : r.size - GUARD].view(dtype).reshape(shape)

    t = carve_separate(man, allocate, window)
    for name, (dtype, values) in man["constants"].items():
        t[name][...] = np.asarray(values, np.dtype(dtype)).reshape(t[name].shape)
    return t, raw


def guards_intact(raw: np.ndarray) -> bool:
    return bool((raw[:GUARD] == GUARD_BYTE).all() and (raw[-GUARD:] == GUARD_BYTE).all())


def load_emulated(
    path: str | Path, reverse: bool = False, layout: str = "arena"
) -> EmulatedCudaProgram:
    """The training program of a CUDA artifact folder with its kernels emulated on the CPU."""
    artifact = StepArtifact.load(path, sources=True)
    return EmulatedCudaProgram(artifact, reverse=reverse, layout=layout)


def emulate(prog: Program, archs: tuple[str, ...] = ("sm_80",)) -> EmulatedCudaProgram:
    """`prog` (a data-parallel worker's too) as its CUDA artifact runs, emulated: the artifact
    built into the kernel cache for `archs` (cuda.build.cached_artifact: needs TVM and nvcc;
    a job's workers build it once), then its kernels and collectives run on the CPU with
    `prog`'s state, step count and workers."""
    from mexc.backends.cuda.build import cached_artifact

    # without the inference artifact: the emulated program predicts with the reference
    artifact = StepArtifact.load(cached_artifact(prog, archs, eval_plan=False))
    return EmulatedCudaProgram(artifact, program=prog.retargeted("cuda"))


def compare(
    path: str | Path, steps: int, reverse: bool = False, seed: int = 0, layout: str = "arena"
) -> list[dict]:
    """Train `steps` steps on one random batch with the emulated artifact and with the
    reference interpreter from the same state: per step the losses, the state checksums, whether
    both agree ("exact") and the emulator's seconds."""
    emu = load_emulated(path, reverse, layout)
    ref = StepArtifact.load(path, sources=True).program
    rng = np.random.default_rng(seed)
    x, y = emu.random_batch(rng)
    rows = []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = emu.step(x, y)
        seconds = round(time.perf_counter() - t0, 2)
        ref_loss = ref.step(x, y)
        checksum, ref_checksum = emu.state_checksum(), ref.state_checksum()
        rows.append(
            {
                "step": step,
                "loss": loss,
                "reference_loss": ref_loss,
                "checksum": checksum,
                "reference_checksum": ref_checksum,
                "exact": loss == ref_loss and checksum == ref_checksum,
                "seconds": seconds,
            }
        )
    return rows


# the launch order runs in the GPU runtime's layout (state region and arena); the reverse order
# with a guarded allocation per buffer, which names a buffer written out of bounds
ORDER_LAYOUT = {"forward": "arena", "reverse": "separate"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", help="a folder written by mexc compile --target cuda")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"artifact": str(args.artifact)}
    exact = True
    for order in ("forward", "reverse"):
        rows = compare(args.artifact, args.steps, order == "reverse", layout=ORDER_LAYOUT[order])
        report[order] = rows
        for r in rows:
            exact &= r["exact"]
            print(
                f"{order} step {r['step']}: loss {r['loss']:.6f} "
                f"(reference {r['reference_loss']:.6f}) checksum {r['checksum']} "
                f"{'==' if r['exact'] else '!='} reference  {r['seconds']} s"
            )
    report["bit_exact"] = exact
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("bit-exact with the reference" if exact else "MISMATCH with the reference")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
