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
from typing import Any

from mexc.backends.cuda.source import KERNEL_DEF

FUSED = "_fused"  # a fused kernel's symbol: its first kernel's, this, then a number
# most distinct buffers of a fused kernel: the CPU emulator's MAX_ARGS (emu.hpp), which must run
# every kernel a GPU runs (a GPU takes 4 KiB of parameters: 512 pointers)
MAX_PARAMS = 48
_POINTER = re.compile(r"^(?P<type>[\w ]+\*)\s*(?:__restrict__\s+)?(?P<name>\w+)$")


def _definitions(source: str) -> dict[str, tuple[int, int, list[str]]]:
    """symbol -> (start, end, C type of each parameter) of each kernel definition; the type is
    "" where a parameter is not a pointer (such a kernel is not fused)."""
    out: dict[str, tuple[int, int, list[str]]] = {}
    for m in KERNEL_DEF.finditer(source):
        params = source[m.end(2) + 1 : source.rindex(")", m.start(), m.end())]
        types = []
        for p in (p.strip() for p in params.split(",") if p.strip()):
            got = _POINTER.match(p)
            types.append(got.group("type").strip() if got else "")
        end = source.find("\n}", m.end())
        out[m.group(2)] = (m.start(), end + 2, types)
    return out


def _device_copy(source: str, symbol: str, span: tuple[int, int, list[str]]) -> str:
    """Kernel `symbol`'s definition as `__device__` function `<symbol>_body`."""
    start, end, _ = span
    text = source[start:end]
    head = KERNEL_DEF.match(text)
    if head is None:  # spans come from KERNEL_DEF: a source that changed under them
        raise ValueError(f"kernel {symbol}: its definition is not where it was found")
    params = text[head.end(2) : text.rindex(")", 0, head.end()) + 1].replace("__restrict__ ", "")
    return f"__device__ __forceinline__ void {symbol}_body{params} {{{text[head.end() :]}\n"


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
    spans = [_definitions(s) for s in sources]
    stops = {c[0] for c in collectives}  # a run may not span a collective

    def fusable(i: int) -> bool:
        module, symbol, grid, block, _ = kernels[i]
        types = spans[module].get(symbol, (0, 0, [""]))[2]
        return (
            list(grid) == [1, 1, 1]
            and block[1:] == [1, 1]
            and symbol not in unfused
            and symbol in spans[module]
            and all(types)
        )

    runs: list[list[int]] = []
    buffers: set[str] = set()  # the last run's
    for i in range(len(kernels)):
        last = runs[-1] if runs else []
        joins = (
            fusable(i)
            and last
            and fusable(last[-1])
            and i not in stops
            and kernels[i][0] == kernels[last[0]][0]
            and kernels[i][3] == kernels[last[0]][3]
            and len(buffers | set(kernels[i][4])) <= MAX_PARAMS
        )
        if joins:
            last.append(i)
            buffers |= set(kernels[i][4])
        else:
            runs.append([i])
            buffers = set(kernels[i][4])

    bodies: list[dict[str, str]] = [{} for _ in sources]
    fused_source: list[list[str]] = [[] for _ in sources]
    out: list[list[Any]] = []
    first_of_run: list[int] = []  # the first old kernel of each new entry
    for run in runs:
        module, symbol, _, block, _ = kernels[run[0]]
        params: dict[str, str] = {}  # buffer -> C type
        for i in run:
            for buf, ctype in zip(kernels[i][4], spans[module][kernels[i][1]][2], strict=True):
                params.setdefault(buf, ctype)
        clash = any(
            params[buf] != ctype
            for i in run
            for buf, ctype in zip(kernels[i][4], spans[module][kernels[i][1]][2], strict=True)
        )
        if len(run) < 2 or clash:  # alone (a buffer read as two C types: each kernel alone)
            first_of_run.extend(run)
            out.extend(kernels[i] for i in run)
            continue
        first_of_run.append(run[0])
        index = {buf: j for j, buf in enumerate(params)}
        calls = []
        for i in run:
            sym, buffers = kernels[i][1], kernels[i][4]
            calls.append(f"  {sym}_body({', '.join(f'p{index[b]}' for b in buffers)});")
            if sym not in bodies[module]:
                bodies[module][sym] = _device_copy(sources[module], sym, spans[module][sym])
        name = f"{symbol}{FUSED}{len(fused_source[module])}"
        args = ", ".join(f"{t} p{j}" for j, t in enumerate(params.values()))
        body = "\n  __syncthreads();\n".join(calls)
        fused_source[module].append(
            f'extern "C" __global__ void __launch_bounds__({block[0]}) {name}({args}) {{\n'
            f"{body}\n}}\n"
        )
        out.append([module, name, [1, 1, 1], list(block), list(params)])

    new_sources = []
    for module, source in enumerate(sources):
        if not fused_source[module]:
            new_sources.append(source)
            continue
        # the bodies before the first kernel (outside every kernel's span), the fused kernels
        # after the last
        first = min(start for start, _, _ in spans[module].values())
        copies = "".join(bodies[module].values())
        fused = "\n".join(fused_source[module])
        new_sources.append(source[:first] + copies + "\n" + source[first:] + "\n" + fused)
    position = {old: new for new, old in enumerate(first_of_run)}
    position[len(kernels)] = len(out)
    renumbered = [[position[p], *rest] for p, *rest in collectives]
    return out, renumbered, new_sources
