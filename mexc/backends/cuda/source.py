"""Reading and fixing TVM's CUDA source text (no TVM needed): the kernels of a module, and the
warp masks of its cross-thread reductions.

TVM's allreduce lowering asks `__activemask()` for the mask of its `__shfl_down_sync` calls.
The CUDA programming guide warns that this is not a mask of the lanes that will reach the
shuffle: since Volta (independent thread scheduling) it names the lanes that happen to be
converged at that instant, and a shuffle that reads a lane outside its mask returns an
undefined value. The first GPU run (H200, 2026-12-04) was bit-exact once a ptxas miscompile was
avoided (te_compaction.iabs), so this hazard did not show there; nothing promises it never will.
Every shuffle TVM emits runs at the kernel's top level, where every thread of the block executes
it, so the mask it needs is known statically: all 32 lanes (the GPU schedule's blocks are whole
warps). `converged_warp_masks` writes that mask in and refuses any other form.
"""

from __future__ import annotations

import re

KERNEL_DEF = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\([^)]*\)\s*\{'
)
# TVM's form: "  mask[0] = __activemask();" at the kernel body's top level (two spaces)
_ACTIVEMASK = re.compile(r"^(?P<indent> *)(?P<lhs>[\w\[\]]+) = __activemask\(\);$", re.M)


def _kernel_spans(source: str) -> list[tuple[int, int, str, str | None]]:
    """(start, end, symbol, launch bounds or None) of each kernel definition in TVM's CUDA
    source: a body runs to the next definition; declarations without a body are skipped."""
    defs = list(KERNEL_DEF.finditer(source))
    ends = [m.start() for m in defs[1:]] + [len(source)]
    return [(m.start(), end, m.group(2), m.group(1)) for m, end in zip(defs, ends)]


def kernel_bodies(source: str) -> dict[str, str]:
    """Each kernel's definition text in TVM's CUDA source, by symbol."""
    return {name: source[start:end] for start, end, name, _ in _kernel_spans(source)}


def converged_warp_masks(source: str) -> str:
    """`source` with every `__activemask()` of a reduction replaced by the mask of the lanes
    that execute it (module docstring). Raises ValueError for a use that is not at a kernel's
    top level or whose kernel has no `__launch_bounds__`: its mask is not known statically."""
    spans = _kernel_spans(source)
    head = source[: spans[0][0]] if spans else source
    if "__activemask" in head:
        raise ValueError("__activemask() outside any kernel")
    bodies = [_fix_kernel(source[start:end], name, bounds) for start, end, name, bounds in spans]
    return head + "".join(bodies)


def _fix_kernel(body: str, symbol: str, bounds: str | None) -> str:
    if "__activemask" not in body:
        return body
    if bounds is None or int(bounds) % 32:
        # a block's last, partial warp: TVM's shuffle tree reads lanes that do not exist
        raise ValueError(
            f"kernel {symbol}: a warp reduction in a block of {bounds or 'unknown'} threads, "
            "not a multiple of 32"
        )

    def replace(m: re.Match[str]) -> str:
        if m.group("indent") != "  ":
            raise ValueError(
                f"kernel {symbol}: __activemask() inside a branch or loop; the lanes that reach "
                "its shuffles are not known statically"
            )
        return f"{m.group('indent')}{m.group('lhs')} = 0xffffffffu;"

    fixed = _ACTIVEMASK.sub(replace, body)
    if "__activemask" in fixed:
        raise ValueError(f"kernel {symbol}: __activemask() in a form the build does not know")
    return fixed
