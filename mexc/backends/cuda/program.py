"""Run an ahead-of-time compiled CUDA training step (docs/cuda.md). Needs neither TVM nor nvcc
nor torch: the artifact folder holds the cubin, the launch plan and the program; running needs
an NVIDIA GPU and CuPy. Loading and validating an artifact needs neither.

    prog = mexc.load_cuda("build/fashion-sm_90")  # validates, then allocates on the GPU
    loss = prog.step(x, y)                                     # same API and bits as the reference
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mexc.backends.cuda.runtime import ARCHS, ArtifactError, cupy_module
from mexc.backends.plan_layout import (
    POISON,
    carve,
    carve_separate,
    check_layout,
    nbytes,
    region_bytes,
    separate_bytes,
)
from mexc.backends.plan_runtime import (
    HOST_KINDS,
    PLAN_FIELDS,
    PlanProgram,
    collective,
    inference_keys,
    share_state,
    window,
)
from mexc.errors import CheckpointError, DistributedError
from mexc.program import Program, read_checkpoint

# 5: int16 probabilities; 4: a data-parallel worker's collectives; 3: key_rows, valid[2]
FORMAT = "mexc-cuda-step-6"
PROGRAM_FILE = "program.mexc"
# an inference artifact beside a training step's (its subfolder) names the step's program file
SHARED_PROGRAM = f"../{PROGRAM_FILE}"
DTYPES = ("int8", "int16", "int32", "int64")

__all__ = ["ARCHS", "FORMAT", "CudaProgram", "StepArtifact", "load_cuda"]


def _fail(path: Path, what: str) -> ArtifactError:
    return ArtifactError(
        f"CUDA artifact {path}: {what}. Rebuild it on a machine with TVM and nvcc: "
        f"mexc compile MODEL --target cuda --arch sm_90 --out {path}"
    )


@dataclass(frozen=True)
class StepArtifact:
    """A validated artifact folder: its manifest, the cubins of each module per architecture
    and the program it trains."""

    path: Path
    manifest: dict[str, Any]
    cubins: list[dict[str, Path]]  # per module: {arch: cubin}
    program: Program

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(self.manifest["archs"])

    def arch_for(self, compute_capability: str) -> str:
        """The artifact's architecture that runs on a GPU of `compute_capability` ("90" for
        H100/H200, "80" for A100, "86" ...): a cubin runs on its own major version at an equal
        or higher minor version."""
        cc = int(compute_capability)
        fits = [a for a in self.archs if int(a[3:]) // 10 == cc // 10 and int(a[3:]) <= cc]
        if not fits:
            raise _fail(
                self.path,
                f"it holds cubins for {list(self.archs)}, none runs on a GPU of compute "
                f"capability {cc // 10}.{cc % 10}",
            )
        return max(fits, key=lambda a: int(a[3:]))

    @staticmethod
    def load(path: str | Path, sources: bool = False) -> StepArtifact:
        """The artifact at `path`, verified; `sources`: an artifact of CUDA sources without
        cubins (build_step(cubins=False)) is taken too (the CPU emulator's)."""
        root = Path(path)
        man = _read_manifest(root, sources)
        cubins = [
            {arch: _verified(root, entry["cubins"][arch]) for arch in man["archs"]}
            for entry in man["modules"]
        ]
        name = man.get("program_file", PROGRAM_FILE)
        if name not in (PROGRAM_FILE, SHARED_PROGRAM):
            raise _fail(root, f"program_file {name!r} is not {PROGRAM_FILE} or {SHARED_PROGRAM}")
        prog_file = _verified(root, {"file": name, "sha256": man["program_sha256"]})
        try:
            prog = read_checkpoint(prog_file)  # the reference executor on its program
        except CheckpointError as err:
            raise _fail(root, f"its program does not load ({err})") from None
        _check_plan(root, man, prog)
        return StepArtifact(root, man, cubins, prog)


def _read_manifest(root: Path, sources: bool = False) -> dict[str, Any]:
    try:
        man = json.loads((root / "plan.json").read_text())
    except FileNotFoundError:
        raise _fail(root, "plan.json is missing") from None
    except json.JSONDecodeError as exc:
        raise _fail(root, f"plan.json is not valid JSON ({exc})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        found = man.get("format") if isinstance(man, dict) else None
        raise _fail(root, f"format is {found!r}, expected {FORMAT!r}")
    fields = ("layout", "archs", "kernels", "collectives", "modules", "program_sha256")
    missing = [k for k in (*PLAN_FIELDS, *fields) if k not in man]
    if missing:
        raise _fail(root, f"plan.json lacks {missing}")
    archs = man["archs"]
    if man.get("sources_only"):
        if not sources:
            raise _fail(
                root,
                "it holds CUDA sources only (built for the CPU emulator, without nvcc); build "
                "it with its cubins",
            )
        return man
    if not archs or any(a not in ARCHS for a in archs):
        raise _fail(root, f"archs {archs!r} are not among {ARCHS}")
    for i, entry in enumerate(man["modules"]):
        if set(entry.get("cubins", {})) != set(archs):
            raise _fail(root, f"module {i} lacks a cubin for one of {archs}")
    return man


def _verified(root: Path, entry: dict[str, Any]) -> Path:
    """The file of a manifest entry {file, sha256}, present and unchanged."""
    path = root / str(entry["file"])
    if not path.is_file():
        raise _fail(root, f"{path.name} is missing")
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry.get("sha256"):
        raise _fail(root, f"{path.name} does not match its SHA-256 in plan.json")
    return path


def _check_plan(root: Path, man: dict[str, Any], prog: Program) -> None:
    """Every name the kernels and the host use is a buffer or view of a known dtype, and the
    state the plan holds is the program's."""
    buffers, views = man["buffers"], man["views"]
    for name, (shape, dtype) in buffers.items():
        if dtype not in DTYPES or any(int(d) <= 0 for d in shape):
            raise _fail(root, f"buffer {name} has shape {shape} / dtype {dtype}")
    for name, (base, shape, offset) in views.items():
        size = int(np.prod(shape))
        if base not in buffers or offset + size > int(np.prod(buffers[base][0])):
            raise _fail(root, f"view {name} does not fit in buffer {base}")
    known = set(buffers) | set(views)
    modules = len(man["modules"])
    for module, symbol, grid, block, args in man["kernels"]:
        if not 0 <= module < modules or len(grid) != 3 or len(block) != 3:
            raise _fail(root, f"kernel {symbol} is malformed")
        if any(a not in known for a in args):
            raise _fail(root, f"kernel {symbol} names an unknown buffer")
    position = 0
    for at, kind, name in man["collectives"]:
        if not position <= at <= len(man["kernels"]) or kind not in HOST_KINDS:
            raise _fail(root, f"collective {kind} at {at} is malformed")
        base = views[name][0] if name in views else name
        if base not in buffers or buffers[base][1] != "int32":
            raise _fail(root, f"collective {kind} names {name!r}, not an int32 buffer")
        position = at
    # an inference plan ("logits") holds the eval path's part of the state
    inference = "logits" in man
    if not set(man["state"]) <= set(prog.state) or (
        not inference and set(man["state"]) != set(prog.state)
    ):
        raise _fail(root, "the plan's state tensors are not the program's")
    try:
        check_layout(man, launch_args(man))
    except ValueError as err:
        raise _fail(root, str(err)) from None


def launch_args(man: dict[str, Any]) -> list[list[str]]:
    """Every launch's buffers in step order: the kernels', and each collective's buffer at its
    place between them (what the layout's lifetimes count)."""
    out: list[list[str]] = []
    for run, after in segments(man):
        out += [man["kernels"][i][4] for i in run]
        out += [[name] for _, name in after]
    return out


def segments(man: dict[str, Any]) -> list[tuple[range, list[tuple[str, str]]]]:
    """The step as runs of kernels, each followed by the collectives ([kind, buffer]) the host
    runs before the next run: one run and no collective in one process."""
    out: list[tuple[range, list[tuple[str, str]]]] = []
    start = 0
    for at, kind, name in man["collectives"]:
        if at > start or not out:
            out.append((range(start, at), []))
            start = at
        out[-1][1].append((kind, name))
    out.append((range(start, len(man["kernels"])), []))
    return out


def refuse_without_workers(man: dict[str, Any], prog: Program, path: Path) -> None:
    """A data-parallel worker's artifact (collectives in its plan) runs only as a worker."""
    if man["collectives"] and prog.workers is None:
        raise DistributedError(
            f"CUDA artifact {path} is a data-parallel worker's step (its plan has "
            f"{len(man['collectives'])} collectives between its kernels) and needs the other "
            "workers: run it with mexc.compile(..., target='cuda', data_parallel=True) or "
            "mexc.load(checkpoint, target='cuda', data_parallel=True) in every process of "
            "the torch.distributed group (docs/distributed.md)"
        )


@dataclass(frozen=True)
class _Inference:
    """An inference artifact bound to a training program's device state."""

    manifest: dict[str, Any]
    buffers: dict[str, Any]
    calls: list[tuple[Any, tuple, tuple, tuple]]
    allocated: int


class CudaProgram(PlanProgram):
    """The training step on the GPU: every plan buffer a window into two device allocations
    (the state region and the arena of plan_layout), the kernels launched in plan order on one
    stream of the program. Same API and bits as the reference; the state stays on the device
    (reading it copies it out).

    graph=True (default; MEXC_CUDA_GRAPH=0 turns it off) captures the step's launch sequence
    as a CUDA graph at the second step and replays it from then on: a ResNet-18 step is
    thousands of small launches, and one graph launch costs far less host time than as many
    kernel launches. The first step launches kernel by kernel, so that a kernel that fails to
    launch says so at its launch and every kernel has run once before the capture. The kernel
    arguments (device pointers, grids, blocks) are resolved once here; the buffers are
    allocated once and never move, and every per-step input (batch, labels, learning rate,
    keys) and load_state_dict write into them in place, so the captured graph is the same step
    every time.

    A data-parallel worker's plan has collectives between its kernels (plan.json
    "collectives"): the host runs each on its device buffer once the kernels before it are
    queued (TorchCollectives.reduce_in_place: NCCL on the program's stream, or the group's CPU
    backend through a host copy), and with graphs every run of kernels between two collectives
    is a graph of its own."""

    def __init__(
        self,
        artifact: StepArtifact,
        device: int = 0,
        program: Program | None = None,
        graph: bool | None = None,
        layout: str = "arena",
    ) -> None:
        if layout not in ("arena", "separate"):
            raise ValueError(f"layout {layout!r} is not 'arena' or 'separate'")
        cp = cupy_module()
        self.separate_buffers = layout == "separate"
        self._cp = cp
        self._device = cp.cuda.Device(device)
        man = artifact.manifest
        self.arch = artifact.arch_for(str(self._device.compute_capability))
        self.use_graph = os.environ.get("MEXC_CUDA_GRAPH", "1") != "0" if graph is None else graph
        self._graphs: list[Any] | None = None  # per segment (None where it has no kernel)
        self._launched = False  # a step has run launch by launch (the capture comes after)
        program = program or artifact.program
        refuse_without_workers(man, program, artifact.path)
        with self._device:
            self._stream = cp.cuda.Stream(non_blocking=True)
            # the arena: the inference plan's share it (None with separate buffers)
            self._t, self._allocated, self._arena = _allocate(cp, man, self.separate_buffers)
            # SHA-256 checked at load
            modules = [cp.RawModule(path=str(c[self.arch])) for c in artifact.cubins]
            self._calls = [
                (
                    modules[module].get_function(symbol),
                    tuple(grid),
                    tuple(block),
                    tuple(self._t[a] for a in args),
                )
                for module, symbol, grid, block, args in man["kernels"]
            ]
        comm = program.workers.comm if program.workers is not None else None
        self._segments = [
            (
                self._calls[run.start : run.stop],
                [self._collective(kind, comm, self._t[name]) for kind, name in after],
            )
            for run, after in segments(man)
        ]
        self.artifact = artifact
        # the inference artifact beside the step (build_step's eval_plan), loaded on first use
        self._inf: _Inference | None = None
        super().__init__(program, man)

    # ----------------------------------------------------------------------------- inference
    # predict / evaluate / logits run the inference artifact's kernels on the step's own state
    # buffers (no copy) and its arena where that is large enough, loaded on first use; without
    # an inference artifact (built without it, or a worker's), the reference runs on a copy of
    # the state

    def _inference_plan(self) -> dict[str, Any] | None:
        folder = self._plan_json.get("inference")
        if not folder or self.workers is not None:
            return None
        if self._inf is None:
            self._inf = self._load_inference(StepArtifact.load(self.artifact.path / folder))
        return self._inf.manifest

    def _load_inference(self, art: StepArtifact) -> _Inference:
        man = art.manifest
        if self.arch not in art.archs:
            raise _fail(art.path, f"it holds no cubin for {self.arch}, the step's architecture")
        with self._device:
            t, allocated, _ = _allocate(self._cp, man, arena=self._arena)
            share_state(man, t, self._t)  # the inference plan reads the live parameters
            keys = inference_keys(self.options.seed, man)
            t[man["keys"]].reshape(-1)[: keys.size].set(keys, self._stream)
            modules = [self._cp.RawModule(path=str(c[self.arch])) for c in art.cubins]
            calls = [
                (
                    modules[module].get_function(symbol),
                    tuple(grid),
                    tuple(block),
                    tuple(t[a] for a in args),
                )
                for module, symbol, grid, block, args in man["kernels"]
            ]
        return _Inference(man, t, calls, allocated)

    def _infer_write(self, name: str, values: np.ndarray) -> None:
        assert self._inf is not None
        flat = self._inf.buffers[name].reshape(-1)
        with self._device:
            flat[: values.size].set(np.ascontiguousarray(values).reshape(-1), self._stream)

    def _infer_read(self, name: str) -> np.ndarray:
        assert self._inf is not None
        with self._device:
            out = np.asarray(self._cp.asnumpy(self._inf.buffers[name], self._stream))
            self._stream.synchronize()
            return out

    def _infer_run(self) -> None:
        assert self._inf is not None
        with self._device:
            self._launch(self._inf.calls)

    def _collective(self, kind: str, comm: Any, buf: Any) -> Any:
        """The call that runs collective `kind` on device buffer `buf`: in place where the
        workers' collectives take a device array (reduce_in_place, on the program's stream),
        else through a host copy."""
        in_place = getattr(comm, "reduce_in_place", None)
        if in_place is not None:
            return lambda: in_place(buf, kind, self._stream.ptr)
        on_host = collective(kind, comm)

        def staged() -> None:
            host = self._cp.asnumpy(buf, self._stream)
            self._stream.synchronize()
            on_host(host)
            buf.set(host, self._stream)

        return staged

    def _write(self, name: str, values: np.ndarray) -> None:
        flat = self._t[name].reshape(-1)
        with self._device:
            flat[: values.size].set(np.ascontiguousarray(values).reshape(-1), self._stream)

    def _read(self, name: str) -> np.ndarray:
        with self._device:
            out = np.asarray(self._cp.asnumpy(self._t[name], self._stream))
            self._stream.synchronize()
            return out

    def allocated_bytes(self) -> dict[str, int]:
        """The step's two device allocations, and those of the inference plan once predict or
        evaluate ran ("eval_device": its own state region, whose parameters go unused as it
        reads the step's, and its arena where the step's is smaller)."""
        inference = self._inf.allocated if self._inf is not None else 0
        return {"host": 0, "device": self._allocated, "eval_device": inference}

    def _launch(self, calls: list[tuple[Any, tuple, tuple, tuple]]) -> None:
        with self._stream:  # CuPy launches on the current stream
            for fn, grid, block, args in calls:
                fn(grid, block, args)

    def _run(self) -> None:
        with self._device:
            if self.use_graph and self._graphs is None and self._launched:
                self._graphs = self._capture()
            for i, (calls, collectives) in enumerate(self._segments):
                if self._graphs is None:
                    self._launch(calls)
                elif self._graphs[i] is not None:
                    self._graphs[i].launch(self._stream)
                with self._stream:
                    for run in collectives:
                        run()
            self._launched = True

    def set_graph(self, enabled: bool) -> None:
        """Replay the step as CUDA graphs (one per run of kernels between collectives; one in
        all in one process), captured at the next step once a step has run launch by launch;
        or launch its kernels one by one."""
        self.use_graph = enabled
        self._graphs = None

    def _capture(self) -> list[Any] | None:
        """Every segment's launch sequence as a CUDA graph, or None (with a note) where capture
        fails."""
        graphs: list[Any] = []
        try:
            for calls, _ in self._segments:
                if not calls:
                    graphs.append(None)
                    continue
                self._stream.begin_capture()
                try:
                    self._launch(calls)
                finally:
                    graphs.append(self._stream.end_capture())
            return graphs
        except Exception as err:  # noqa: BLE001 - an old CuPy or driver: launch one by one
            print(f"mexc: CUDA graph capture failed ({err}); launching kernels one by one")
            self.use_graph = False
            return None

    def kernel_times(self, x: Any, y: Any, repeats: int = 3) -> dict[str, float]:
        """Seconds per kernel (best of `repeats` steps, CUDA events), keyed by position and
        symbol. Trains `repeats` steps."""
        cp = self._cp
        best: dict[str, float] = {}
        for _ in range(repeats):
            self.step(x, y)
            with self._device:
                for i, ((fn, grid, block, args), entry) in enumerate(
                    zip(self._calls, self._plan_json["kernels"])
                ):
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record(self._stream)
                    with self._stream:
                        fn(grid, block, args)
                    end.record(self._stream)
                    end.synchronize()
                    key = f"{i:04d} {entry[1]}"
                    ms = cp.cuda.get_elapsed_time(start, end)
                    best[key] = min(best.get(key, float("inf")), ms / 1e3)
        return best

    def synchronize(self) -> None:
        with self._device:
            self._stream.synchronize()


def _allocate(
    cp: Any, man: dict[str, Any], separate: bool = False, arena: Any = None
) -> tuple[dict[str, Any], int, Any]:
    """Two device allocations, the state region (zeroed) and the arena (poisoned:
    plan_layout), every buffer and view a window into them, constants uploaded; the bytes
    allocated, and the arena (None with `separate`). `separate`: one allocation per buffer
    instead (poisoned where the layout puts the buffer in the arena), for diagnosing a
    mismatch buffer by buffer. `arena`: another plan's arena, used where it is large enough
    (plans that never run at the same time: every launch writes the arena bytes it reads)."""
    if separate:

        def allocate(name: str, shape: tuple[int, ...], dtype: str, fill: int) -> Any:
            raw = cp.zeros(nbytes(shape, dtype), dtype="uint8")
            if fill:
                raw.fill(fill)
            return raw.view(dtype).reshape(shape)

        t = carve_separate(man, allocate, window)
        allocated = separate_bytes(man)
        arena = None
    else:
        sizes = region_bytes(man)
        regions = {"state": cp.zeros(max(sizes["state"], 1), dtype="uint8")}
        if arena is not None and arena.nbytes >= sizes["arena"]:
            regions["arena"] = arena
        else:
            regions["arena"] = cp.zeros(max(sizes["arena"], 1), dtype="uint8")
            regions["arena"].fill(POISON)
        t = carve(man, regions, window)
        allocated = sum(int(r.nbytes) for r in regions.values() if r is not arena)
        arena = regions["arena"]
    for name, (dtype, values) in man["constants"].items():
        t[name].set(np.asarray(values, np.dtype(dtype)).reshape(t[name].shape))
    return t, allocated, arena


def load_cuda(
    path: str | Path, device: int = 0, graph: bool | None = None, layout: str = "arena"
) -> CudaProgram:
    """The training program of a CUDA artifact folder, on GPU `device` (CuPy): its state and
    step count are the artifact's (a checkpoint can be loaded with load_state_dict).
    layout="separate": one device allocation per buffer (diagnosis; CudaProgram)."""
    return CudaProgram(StepArtifact.load(path), device, graph=graph, layout=layout)
