"""Where every buffer of a launch plan lives: one persistent region and one arena.

A compiled step (llvm or CUDA) is a list of kernel launches over named buffers (docs/cpu.md).
The layout puts every buffer at a byte offset of one of two allocations:

- **state**: what must survive between steps or is touched by the host: the parameters,
  velocities and running statistics, the constants, and the per-step host inputs and outputs
  (quantized batch, labels, valid count, learning rate, stream keys, probabilities; the
  logits of an inference plan);
- **arena**: everything else (activations saved for the backward pass, gradients, GEMM packs and
  accumulators, exponents, kernel scratch). A buffer is live from the first launch that names it
  (through any view) to the last; buffers whose lifetimes do not overlap share bytes
  (`mexc.arena.place`).

Every launch writes the arena bytes it later reads within the same step (a freshly allocated
arena is filled with POISON so that a kernel relying on zeroed memory fails the bit-exact tests
at once instead of on some later model). The layout is computed at compile time and stored in
the manifest ("layout"); the runtimes only carve views. Imports neither TVM nor torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mexc.arena import overlaps, place

ALIGN = 64  # bytes: a cache line, TVM's default buffer alignment and an AVX-512 vector
POISON = 0xA5  # fill byte of a fresh arena
REGIONS = ("state", "arena")


def nbytes(shape: Sequence[int], dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _root(views: dict[str, Any], name: str) -> str:
    return views[name][0] if name in views else name


def persistent_names(manifest: dict[str, Any]) -> set[str]:
    """Buffers (roots of views) that live in the state region."""
    views = manifest["views"]
    names: set[str] = set(manifest["constants"])
    for m, e in manifest["state"].values():
        names |= {m, e}
    names |= set(manifest["input"])
    names |= {manifest[k] for k in ("keys", "labels", "valid", "lr", "loss_rows") if manifest[k]}
    names |= set(manifest.get("logits", ()))  # the inference plan's result
    return {_root(views, n) for n in names if n}


def lifetimes(
    manifest: dict[str, Any], launch_args: Sequence[Sequence[str]]
) -> dict[str, tuple[int, int]]:
    """(first, last) launch index of every buffer named by a launch (through its views)."""
    views = manifest["views"]
    out: dict[str, tuple[int, int]] = {}
    for i, args in enumerate(launch_args):
        for a in args:
            r = _root(views, a)
            first, _ = out.get(r, (i, i))
            out[r] = (first, i)
    return out


def plan_layout(manifest: dict[str, Any], launch_args: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The layout of a plan manifest (buffers, views, constants, host-facing names) whose
    kernels take `launch_args` in order: {"align", "state_bytes", "arena_bytes", "offsets":
    {buffer: [region, byte offset]}}."""
    buffers = manifest["buffers"]
    keep = persistent_names(manifest)
    life = lifetimes(manifest, launch_args)
    offsets: dict[str, list[Any]] = {}
    state = 0
    items = []
    for name, (shape, dtype) in buffers.items():
        size = nbytes(shape, dtype)
        if name in keep or name not in life:  # a buffer no launch names stays (host-only)
            offsets[name] = ["state", state]
            state += (size + ALIGN - 1) // ALIGN * ALIGN
        else:
            items.append((life[name][0], life[name][1], size, name))
    placed, peak = place(items, ALIGN)
    for name, offset in placed.items():
        offsets[str(name)] = ["arena", int(offset)]
    arena = (peak + ALIGN - 1) // ALIGN * ALIGN
    return {"align": ALIGN, "state_bytes": state, "arena_bytes": arena, "offsets": offsets}


def check_layout(manifest: dict[str, Any], launch_args: Sequence[Sequence[str]]) -> None:
    """ValueError unless the manifest's layout keeps every buffer inside its region, aligned,
    and apart from every buffer live at the same time (a damaged or hand-edited plan.json)."""
    layout = manifest["layout"]
    life = lifetimes(manifest, launch_args)
    sizes = {"state": int(layout["state_bytes"]), "arena": int(layout["arena_bytes"])}
    items = []
    for name, (shape, dtype) in manifest["buffers"].items():
        if name not in layout["offsets"]:
            raise ValueError(f"layout: buffer {name} has no offset")
        region, offset = layout["offsets"][name]
        size = nbytes(shape, dtype)
        if region not in REGIONS or offset % ALIGN or not 0 <= offset <= sizes[region] - size:
            raise ValueError(f"layout: buffer {name} does not fit region {region!r} at {offset}")
        if region == "arena":
            first, last = life.get(name, (0, len(launch_args)))
            items.append((first, last, size, name))
    offsets = {str(k): int(v[1]) for k, v in layout["offsets"].items()}
    clash = overlaps(items, offsets)
    if clash:
        raise ValueError(f"layout: buffers {clash[0][0]} and {clash[0][1]} are live together")


def carve(
    manifest: dict[str, Any], regions: dict[str, Any], window: Callable[[Any, Any, int], Any]
) -> dict[str, Any]:
    """Typed views of every buffer into `regions` ({"state": bytes, "arena": bytes}: uint8
    1-D arrays, numpy or CuPy), then of every plan view into its buffer (`window`)."""
    out: dict[str, Any] = {}
    for name, (shape, dtype) in manifest["buffers"].items():
        region, offset = manifest["layout"]["offsets"][name]
        size = nbytes(shape, dtype)
        raw = regions[region][offset : offset + size]
        out[name] = raw.view(np.dtype(dtype)).reshape(tuple(int(d) for d in shape))
    for name, (base, shape, offset) in manifest["views"].items():
        out[name] = window(out[base], shape, offset)
    return out


def carve_separate(
    manifest: dict[str, Any],
    allocate: Callable[[str, tuple[int, ...], str, int], Any],
    window: Callable[[Any, Any, int], Any],
) -> dict[str, Any]:
    """One allocation per buffer instead of the two regions: `allocate(name, shape, dtype,
    fill)` returns buffer `name` filled with byte `fill` (POISON where the layout puts the
    buffer in the arena; 0 elsewhere, and where a manifest has no layout), then every plan view
    into its buffer (`window`). For A/B measurements and for diagnosing a mismatch buffer by
    buffer."""
    offsets = manifest.get("layout", {}).get("offsets", {})
    out: dict[str, Any] = {}
    for name, (shape, dtype) in manifest["buffers"].items():
        fill = POISON if offsets.get(name, ["state"])[0] == "arena" else 0
        out[name] = allocate(name, tuple(int(d) for d in shape), dtype, fill)
    for name, (base, shape, offset) in manifest["views"].items():
        out[name] = window(out[base], shape, offset)
    return out


def region_bytes(manifest: dict[str, Any]) -> dict[str, int]:
    """Bytes of each region: what a runtime allocates for the plan."""
    layout = manifest["layout"]
    return {"state": int(layout["state_bytes"]), "arena": int(layout["arena_bytes"])}


def separate_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of one allocation per buffer (what the runtimes allocated before the layout)."""
    return sum(nbytes(s, d) for s, d in manifest["buffers"].values())
