"""Compiled host kernels shared by every program built with the same kernel cache.

Programs that differ only in a few nodes (another optimizer setting, lean levels, the inference
plan of a trained step, the same model in another test) have most kernels in common. Each
distinct scheduled PrimFunc is compiled once per cache, whichever program it came from:

- a kernel's name is a hash of its scheduled PrimFunc (TVM's structural hash, the workload key
  meta_schedule's tuning database persists too), the target, TVM's version and the lowering
  code (`salt`), so equal kernels have equal names and are found again;
- the kernels a program lacks are compiled together into new shared libraries ("parts"), one
  per worker process (workers.forked_map), under `parts/` with content-derived names;
- one small index file per kernel, written after its part, names that part.

Every file is written to a temporary name and renamed into place, so readers see whole files
only; two processes that compile the same kernel at once each write a valid part and index
entry, and either is used. A part that fails to load is deleted (`forget`): the next build
compiles its kernels again.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from mexc.backends.kernel_cache import write_atomic
from mexc.lowering.workers import forked_map, split_symbols

STORE = "llvm-kernels"
KERNEL_PREFIX = "mexc_k"  # the compiled name of every kernel: this, then a hash
PER_WORKER = 8  # fewest kernels per worker process (a fork and a TVM build each)
# Without TVM's checks of each call's arguments (type, dtype, shape, strides, alignment of every
# buffer), which were 60 % of the machine code and a quarter of the compile time (SmallResNet at
# batch 2, 205 kernels: 1.17 MB of text and 13.9 s, against 0.46 MB and 10.7 s). The runtime
# passes the plan's own buffers, fixed when the plan is built, and step_plan.check_launch_args
# checks every launch's buffers against its kernel's parameters then, once.
COMPILE_CONFIG = {"tirx.disable_assert": True}


def kernel_name(func: tirx.PrimFunc, salt: str) -> str:
    """The compiled symbol of scheduled `func`: equal for structurally equal kernels."""
    shape = tvm_ffi.structural_hash(func.with_attr("global_symbol", "k"))
    key = f"{shape} {salt} {sorted(COMPILE_CONFIG.items())}"
    return KERNEL_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:24]


class KernelStore:
    """The compiled kernels under `root` (the kernel cache folder)."""

    def __init__(self, root: Path) -> None:
        self.parts = root / STORE / "parts"
        self.index = root / STORE / "index"

    def part_of(self, name: str) -> Path | None:
        """The part holding kernel `name`, if it was compiled and its part is still there."""
        try:
            part = self.parts / (self.index / name).read_text()
        except (OSError, ValueError):
            return None
        return part if part.is_file() else None

    def compile(self, funcs: dict[str, tirx.PrimFunc], target: Any, salt: str) -> dict[str, Any]:
        """symbol -> [part file name, compiled name] for every kernel of `funcs` (keyed by launch
        symbol), compiling those the store lacks."""
        names = {s: kernel_name(f, salt) for s, f in funcs.items()}
        part: dict[str, str] = {}  # compiled name -> its part's file name
        todo: dict[str, tirx.PrimFunc] = {}
        for symbol, name in names.items():
            if name in part or name in todo:
                continue
            path = self.part_of(name)
            if path is not None:
                part[name] = path.name
            else:
                todo[name] = funcs[symbol].with_attr("global_symbol", name)
        if todo:
            self.parts.mkdir(parents=True, exist_ok=True)
            self.index.mkdir(parents=True, exist_ok=True)
            groups = split_symbols(list(todo), PER_WORKER)
            jobs = [(group, self.parts) for group in groups]
            built = forked_map(_compile_part, jobs, {"funcs": todo, "target": target})
            for group, file in zip(groups, built):
                for name in group:
                    write_atomic(self.index / name, functools.partial(Path.write_text, data=file))
                    part[name] = file
        return {symbol: [part[name], name] for symbol, name in names.items()}

    def forget(self, part: str) -> None:
        """Delete a part that does not load: its kernels are compiled again on the next build."""
        (self.parts / part).unlink(missing_ok=True)

    def forget_kernel(self, name: str) -> None:
        """Drop kernel `name`'s index entry (its part lacks it): the next build compiles it."""
        (self.index / name).unlink(missing_ok=True)


def _compile_part(job: tuple[list[str], Path], shared: dict[str, Any]) -> str:
    names, folder = job
    funcs, target = shared["funcs"], shared["target"]
    part = hashlib.sha256(" ".join(sorted(names)).encode()).hexdigest()[:24] + ".so"
    with tvm.transform.PassContext(config=COMPILE_CONFIG):
        ex = tvm.compile(tvm.IRModule({n: funcs[n] for n in names}), target=target)
    write_atomic(folder / part, lambda tmp: ex.export_library(str(tmp)))
    return part
