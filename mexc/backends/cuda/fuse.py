"""Runs of one-block kernels launched as one kernel.

Most kernels of a step over a small tensor (a bias's or a batch-norm parameter's update, the
shift of a per-channel statistic) run on one thread block: TVM makes a kernel of every stage of
a PrimFunc, and the plan a launch of every PrimFunc, so a 64-element parameter's SGD update is
about 20 launches of a few hundred nanoseconds of work each. On the H200 a launch took about
5 us in a CUDA graph (docs/cuda.md), so these steps were bound by their launches.

A run of consecutive kernels that each launch one block of the same shape becomes one kernel
whose threads call each kernel's body in turn, with a block barrier between them:
`__syncthreads()` orders every global and shared memory access of the block's threads before
it against those after it (CUDA C++ Programming Guide, "Synchronization Functions"), which is
what the launch boundary gave a single block. Each body is the kernel's own text as TVM wrote
it, made a `__device__` function (parameters without `__restrict__`: two of a run's buffers may
be views of one allocation); the fused kernel takes the run's distinct buffers once. Every
thread of the block calls every body, so the barriers and full-mask warp shuffles inside the
bodies still run in every thread, as in their own launch.

Not fused: GEMMs (the SASS check finds their tensor-core instructions by kernel), kernels of
more than one block or of another block shape than the run's, and a run across a data-parallel
collective (the host runs it between two kernels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mexc.backends.cuda.source import KERNEL_DEF

FUSED = "_fused"  # a fused kernel's symbol: its first kernel's, this, then a number
# most distinct buffers of a fused kernel: the CPU emulator's MAX_ARGS (emu.hpp), which must run
# every kernel a GPU runs (a GPU takes 4 KiB of parameters: 512 pointers)
MAX_PARAMS = 48
_POINTER = re.compile(r"^(?P<type>[\w ]+\*)\s*(?:__restrict__\s+)?(?P<name>\w+)$")


@dataclass(frozen=True)
class _Definition:
    """A kernel's definition in its module's source."""

    start: int  # where its header starts
    body: str  # its text after the opening brace, through the closing one
    params: str  # its parameter list without `__restrict__`
    types: list[str]  # each parameter's C type; "" where it is not a pointer (not fused)

    def device_copy(self, symbol: str) -> str:
        """The kernel as `__device__` function `<symbol>_body`."""
        return f"__device__ __forceinline__ void {symbol}_body({self.params}) {{{self.body}\n"


def _definitions(source: str) -> dict[str, _Definition]:
    """Each kernel definition of `source`, by symbol."""
    out: dict[str, _Definition] = {}
    for m in KERNEL_DEF.finditer(source):
        params = source[m.end(2) + 1 : source.rindex(")", m.start(), m.end())]
        types = []
        for p in (p.strip() for p in params.split(",") if p.strip()):
            got = _POINTER.match(p)
            types.append(got.group("type").strip() if got else "")
        end = source.find("\n}", m.end()) + 2
        out[m.group(2)] = _Definition(
            m.start(), source[m.end() : end], params.replace("__restrict__ ", ""), types
        )
    return out


def fuse_one_block_runs(
    kernels: list[list[Any]],
    collectives: list[list[Any]],
    sources: list[str],
    unfused: set[str],
) -> tuple[list[list[Any]], list[list[Any]], list[str]]:
    """`kernels` ([module, symbol, grid, block, buffers] in launch order; build._kernel_list)
    with every run of at least two consecutive one-block kernels of one block shape and one
    module launched as one kernel (module docstring), `collectives` ([position, kind, buffer]:
    after the first `position` kernels) renumbered, and `sources` (one per module) with the
    fused kernels added. `unfused`: symbols kept on their own (the GEMMs)."""
    defs = [_definitions(s) for s in sources]
    stops = {c[0] for c in collectives}  # a run may not span a collective

    def fusable(module: int, symbol: str, grid: list[int], block: list[int]) -> bool:
        d = defs[module].get(symbol)
        one_block = list(grid) == [1, 1, 1] and block[1:] == [1, 1]
        return d is not None and all(d.types) and one_block and symbol not in unfused

    ok = [fusable(*k[:4]) for k in kernels]
    runs: list[list[int]] = []
    run_buffers: set[str] = set()  # the last run's
    for i, (module, _, _, block, buffers) in enumerate(kernels):
        last = runs[-1] if runs else []
        joins = (
            ok[i]
            and last
            and ok[last[-1]]
            and i not in stops
            and module == kernels[last[0]][0]
            and block == kernels[last[0]][3]
            and len(run_buffers | set(buffers)) <= MAX_PARAMS
        )
        if joins:
            last.append(i)
            run_buffers |= set(buffers)
        else:
            runs.append([i])
            run_buffers = set(buffers)

    bodies: list[dict[str, str]] = [{} for _ in sources]
    fused_source: list[list[str]] = [[] for _ in sources]
    out: list[list[Any]] = []
    first_of_run: list[int] = []  # the first old kernel of each new entry
    for run in runs:
        module, symbol, _, block, _ = kernels[run[0]]
        types: dict[str, set[str]] = {}  # buffer -> the C types its kernels read it as
        for i in run:
            for buf, ctype in zip(kernels[i][4], defs[module][kernels[i][1]].types, strict=True):
                types.setdefault(buf, set()).add(ctype)
        # alone: a single kernel, or a run that reads a buffer as two C types
        if len(run) < 2 or any(len(t) > 1 for t in types.values()):
            first_of_run.extend(run)
            out.extend(kernels[i] for i in run)
            continue
        first_of_run.append(run[0])
        index = {buf: j for j, buf in enumerate(types)}
        calls = []
        for i in run:
            sym, buffers = kernels[i][1], kernels[i][4]
            calls.append(f"  {sym}_body({', '.join(f'p{index[b]}' for b in buffers)});")
            if sym not in bodies[module]:
                bodies[module][sym] = defs[module][sym].device_copy(sym)
        name = f"{symbol}{FUSED}{len(fused_source[module])}"
        args = ", ".join(f"{t.pop()} p{j}" for j, t in enumerate(types.values()))
        body = "\n  __syncthreads();\n".join(calls)
        fused_source[module].append(
            f'extern "C" __global__ void __launch_bounds__({block[0]}) {name}({args}) {{\n'
            f"{body}\n}}\n"
        )
        out.append([module, name, [1, 1, 1], list(block), list(types)])

    new_sources = []
    for module, source in enumerate(sources):
        if not fused_source[module]:
            new_sources.append(source)
            continue
        # the bodies before the first kernel (outside every kernel's span), the fused kernels
        # after the last
        first = min(d.start for d in defs[module].values())
        copies = "".join(bodies[module].values())
        fused = "\n".join(fused_source[module])
        new_sources.append(source[:first] + copies + "\n" + source[first:] + "\n" + fused)
    position = {old: new for new, old in enumerate(first_of_run)}
    position[len(kernels)] = len(out)
    renumbered = [[position[p], *rest] for p, *rest in collectives]
    return out, renumbered, new_sources
