"""Channel exponents in the C step (docs/numerics.md section 5, docs/mcu.md).

Below 8 bits a program rounds every batch-major result per channel (axis 1 of the shape the
reference computes it in; the op's `channels_last` says a linear layer's features) and every
weight per row. The runtime's kernels learn where the channels lie from `mexc_chan_t`
geometries: the step points `ctx.chan` at a table of two (the node's results 0 and 1) around
each kernel call, and an update's `rows` at the weight's. Which of a kernel's compactions round
per channel is the kernel's own rule (its sinks' result slot, mirroring `compact_mx(...,
batch=True)` of mexc/kernels); the geometry is this module's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mexc.ir import Graph, Node
from mexc.numerics import row_geometry
from mexc.ops import op_def

Geometry = tuple[int, int]  # (channels, elements per channel and sample); (0, 1): none
SLOTS = 2  # result slots a kernel call may round per channel (matmul_grad: da, db)


def result_geometry(shape: tuple[int, ...], last: bool) -> Geometry:
    """Where the channels of a batch-major result of `shape` lie (none below rank 2): axis 1,
    or the last axis (`last`: OpDef.channels_last)."""
    if len(shape) < 2:
        return (0, 1)
    if last:
        return (int(shape[-1]), 1)
    return (int(shape[1]), int(np.prod(shape[2:], dtype=np.int64)))


@dataclass
class ChannelTables:
    """The `mexc_chan_t` tables of one program, one per distinct pair of geometries, over
    shared per-slot arrays sized for the widest."""

    tables: dict[tuple[Geometry, ...], str] = field(default_factory=dict)

    def for_node(self, g: Graph, n: Node) -> str | None:
        """The table the call(s) of n round by, or None when nothing of n has channels (a node
        without rounding sites, a reshape or a ReLU, compacts nothing)."""
        if int(getattr(n.attrs, "rid", -1)) < 0:
            return None
        d = op_def(n.op)
        if d.updates_state:  # its first input is the parameter (a weight, or running stats)
            geoms: tuple[Geometry, ...] = (row_geometry(tuple(g.type_of(n.inputs[0]).shape)),)
        else:
            results = [n.result(i) for i in range(min(len(n.types), SLOTS))]
            shapes = [tuple(g.type_of(v).shape) for v in results]
            geoms = tuple(result_geometry(s, d.channels_last) for s in shapes)
        if not any(c for c, _ in geoms):
            return None
        geoms = geoms + ((0, 1),) * (SLOTS - len(geoms))
        return self.tables.setdefault(geoms, f"mexc_chan{len(self.tables)}")

    def widest(self, slot: int) -> int:
        return max((geoms[slot][0] for geoms in self.tables), default=0)

    @property
    def ram_bytes(self) -> int:
        """The words' RAM: one per channel of each slot (its maximum, then its shifts)."""
        return 4 * sum(self.widest(i) for i in range(SLOTS))

    def declarations(self) -> list[str]:
        out = []
        for i in range(SLOTS):
            if w := self.widest(i):
                out.append(f"static uint32_t mexc_ch{i}_word[{w}];")
        for geoms, name in self.tables.items():
            rows = ", ".join(
                f"{{{c}u, {inner}u, mexc_ch{i}_word}}" if c else "{0u, 1u, 0}"
                for i, (c, inner) in enumerate(geoms)
            )
            out.append(f"static const mexc_chan_t {name}[{SLOTS}] = {{{rows}}};")
        return out
