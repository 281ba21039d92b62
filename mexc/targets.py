"""The targets a Program runs on, in one registry, and `mexc.load`.

Layering (tests/unit/test_import_graph.py keeps it free of import cycles):

    mexc.program        the run side: Program (the reference executor), checkpoints
    mexc.backends.*     the compiled backends, each a Program subclass built from a Program
    mexc.targets        this registry: name -> how to build that backend from a Program
    mexc.compiler       the compile side (torch.fx, the pass pipeline), then a target's build

A target's `build` imports its backend when called, so importing this module (or loading a
checkpoint onto the reference) pulls in neither TVM nor torch.

    prog = mexc.load("run.mexc")                       # the target it was saved from
    prog = mexc.load("run.mexc", target="reference")   # or another one
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from mexc.errors import CheckpointError, DistributedError, MexcError, UnsupportedOpError
from mexc.program import Program, read_checkpoint

if TYPE_CHECKING:
    from mexc.distributed import Workers

# what building a target may need on this machine, as the error messages name it
NEEDS = {
    "tvm": "TVM",
    "cc": "a C compiler (cc)",
    "nvcc": "nvcc",
    "gpu": "CuPy with an NVIDIA GPU",
}


@dataclass(frozen=True)
class Target:
    """One target: `build(prog)` is `prog` (a Program of any target: its graph, state,
    optimizer and step count are what counts) on this target, with options.target set to the
    target it ended up on ("auto" ends up on llvm or reference)."""

    name: str
    summary: str  # what runs the training step (CLI help)
    needs: tuple[str, ...]  # keys of NEEDS: what building it needs here
    host: bool  # runs on the host CPU (the targets `mexc train` offers)
    build: Callable[[Program], Program]


def _reference(prog: Program) -> Program:
    if type(prog) is Program and prog.options.target == "reference":
        return prog
    return prog.retargeted("reference")


def on_host_backend(prog: Program, required: bool = True) -> Program:
    """`prog` with its step compiled by TVM for the host CPU (target "llvm"). Not required
    ("auto"): a model with an op the llvm backend does not lower yet, or a machine without TVM,
    keeps the reference executor (same results, slower), with a note on stderr."""
    try:
        from mexc.backends.llvm.step import LlvmProgram  # TVM builds the step for the host
    except ImportError as err:
        if required:
            raise
        print(f"mexc: TVM is not available ({err}); using the reference executor", file=sys.stderr)
        return prog.retargeted("reference")
    try:
        return LlvmProgram(prog.retargeted("llvm"))
    except UnsupportedOpError as err:
        if required:
            raise
        first = str(err).split(". ")[0]
        print(f"mexc: {first}; using the reference executor", file=sys.stderr)
        return prog.retargeted("reference")


def c_steps_hint(prog: Program) -> int:
    """The steps the C program's learning-rate table covers: the schedule's steps, at least
    2^16, doubled until at least 2^15 steps remain past the program's step (a loaded
    checkpoint). A schedule constant from an earlier step takes a table to there (CProgram)."""
    hint = max(int(getattr(prog.optimizer.schedule, "total_steps", 0)), 1 << 16)
    while hint - prog.step_count < 1 << 15:
        hint *= 2
    return hint


def on_host_c(prog: Program) -> Program:
    """`prog` with its step running the generated C, built by the host's cc (ctypes)."""
    from mexc.backends.c.host import CProgram

    return CProgram(prog.retargeted("c"), steps_hint=c_steps_hint(prog))


def on_gpu(prog: Program) -> Program:
    """`prog` with its step compiled for the GPU of this machine (TVM and nvcc build the artifact
    into the kernel cache; CuPy runs it). A GPU machine without TVM runs an artifact built
    elsewhere: `mexc compile ... --target cuda --out DIR`, then `mexc.load_cuda(DIR)`."""
    from mexc.backends.cuda.program import CudaProgram, StepArtifact
    from mexc.backends.cuda.runtime import cupy_module

    cp = cupy_module()  # a clear error before a minute of building, where CuPy is missing
    from mexc.backends.cuda.build import cached_artifact

    folder = cached_artifact(prog)
    device = 0
    if prog.workers is not None:  # torchrun's workers on one machine: one GPU each
        device = int(os.environ.get("LOCAL_RANK", "0")) % cp.cuda.runtime.getDeviceCount()
    return CudaProgram(StepArtifact.load(folder), device, program=prog.retargeted("cuda"))


def _registry(*targets: Target) -> Mapping[str, Target]:
    return MappingProxyType({t.name: t for t in targets})


TARGETS: Mapping[str, Target] = _registry(
    Target("reference", "the reference executor (numpy)", (), True, _reference),
    Target("llvm", "TVM-compiled host code", ("tvm",), True, on_host_backend),
    Target("c", "the generated C, built by the host cc", ("tvm", "cc"), True, on_host_c),
    Target(
        "auto",
        "llvm where TVM lowers every op, else reference",
        (),
        True,
        lambda prog: on_host_backend(prog, required=False),
    ),
    Target(
        "cuda",
        "the GPU (an ahead-of-time CUDA artifact, run by CuPy)",
        ("tvm", "nvcc", "gpu"),
        False,
        on_gpu,
    ),
)
NAMES = tuple(TARGETS)  # mexc.compile's and `mexc compile --target`'s choices
HOST_NAMES = tuple(name for name, t in TARGETS.items() if t.host)  # `mexc train --target`


def get(name: str) -> Target:
    """The target called `name`; a ValueError naming the choices otherwise."""
    if name not in TARGETS:
        raise ValueError(f"target {name!r} is not available yet; choose one of {NAMES}")
    return TARGETS[name]


def build(prog: Program, name: str) -> Program:
    """`prog` on target `name` (Target.build)."""
    return get(name).build(prog)


# the targets whose step runs as a data-parallel worker ("auto" among them: llvm where it lowers
# every op, else the reference)
DATA_PARALLEL_TARGETS = ("reference", "llvm", "cuda")


def refuse_data_parallel_target(target: str) -> None:
    """A clear error for a target that cannot run a data-parallel worker's step yet."""
    if target in DATA_PARALLEL_TARGETS or target == "auto":
        return
    raise DistributedError(
        f"data_parallel=True runs on target {', '.join(map(repr, DATA_PARALLEL_TARGETS))}, "
        f"not {target!r}: a microcontroller runs one worker. Compile with target='llvm' or "
        f"'reference' (the same bits as every target), or train in one process on {target!r} "
        "(docs/distributed.md)"
    )


def worker_program(prog: Program, workers: Workers, target: str = "reference") -> Program:
    """`prog` split over `workers` by the shard-batch pass, not yet built for `target`: its
    graph holds this worker's rows, its global_graph the whole batch's."""
    from mexc.pass_manager import PassContext
    from mexc.passes.shard_batch import shard_batch

    whole = prog.global_graph
    graph = shard_batch(whole, PassContext(world=workers.world))
    opts = replace(prog.options, target=target)
    return Program(graph, prog.state, opts, prog.optimizer, prog.step_count, workers, whole)


def as_data_parallel_worker(prog: Program, target: str = "reference") -> Program:
    """`prog` (a single-process program: compiled, or loaded from a checkpoint) as this
    process's worker of the initialised torch.distributed group: the shard-batch pass splits
    its batch over the group's workers. A checkpoint saved at any number of workers resumes
    here at this number, with the same bits as one process on the whole batch. `target`: one of
    DATA_PARALLEL_TARGETS (or "auto")."""
    from mexc.distributed import agree_on_program, current_workers

    workers = current_workers()
    worker = worker_program(prog, workers, target)
    agree_on_program(workers, worker)
    return get(target).build(worker)


def load(
    path: str | os.PathLike[str], target: str | None = None, data_parallel: bool = False
) -> Program:
    """Load a checkpoint written by Program.save (no pickle; verified) onto the target it was
    saved from, or onto `target` when given. Where that target cannot be built on this machine
    (no TVM, cc, nvcc, GPU or CuPy; an op it does not lower) the CheckpointError names it and
    how to load the checkpoint elsewhere: target="reference" runs anywhere, same bits.
    `data_parallel`: resume as this process's worker of the initialised torch.distributed
    group (as_data_parallel_worker), on `target` (default the reference)."""
    p = Path(path)
    if data_parallel:
        refuse_data_parallel_target(target or "reference")
        return as_data_parallel_worker(read_checkpoint(p), target or "reference")
    asked = None if target is None else get(target)
    prog = read_checkpoint(p)
    saved = prog.options.target
    if asked is None and saved not in TARGETS:
        raise CheckpointError(
            f"checkpoint {p} was saved from target {saved!r}, which this mexc does not know "
            f"(it knows {NAMES}); load it with mexc.load({str(p)!r}, target='reference')."
        )
    chosen = asked or TARGETS[saved]
    try:
        return chosen.build(prog)
    except (ImportError, OSError, RuntimeError, MexcError) as err:
        raise _unavailable(p, saved, chosen, err) from err


def _unavailable(p: Path, saved: str, chosen: Target, err: BaseException) -> CheckpointError:
    asked = (
        f"its saved target {saved!r}"
        if chosen.name == saved
        else f"target {chosen.name!r} (saved from {saved!r})"
    )
    *most, last = [NEEDS[n] for n in chosen.needs] or [""]
    needs = f"{', '.join(most)} and {last}" if most else last
    reason = " ".join(str(err).split())[:400].rstrip(".")
    text = (
        f"cannot load checkpoint {p} onto {asked} on this machine"
        + (f" (it needs {needs})" if needs else "")
        + f": {type(err).__name__}: {reason}. Pass target= to load it onto another target, "
        f"e.g. mexc.load({str(p)!r}, target='reference'): the same results, run by the "
        "reference executor"
    )
    if chosen.name == "cuda":
        text += (
            "; or run an artifact built on a machine with TVM and nvcc (mexc compile ... "
            "--target cuda --out DIR) with mexc.load_cuda(DIR) and load_state_dict"
        )
    return CheckpointError(text + ".")
