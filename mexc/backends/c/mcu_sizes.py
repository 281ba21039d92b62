"""Flash and RAM of a built MCU image: section sizes plus a worst-case stack bound.

The stack bound is the heaviest call chain from the reset handler in the call graph GCC writes
with `-fcallgraph-info=su` (one .ci file per object, every frame static). A cycle (recursion) or
a dynamically sized frame is an error: the program must have a static worst case. Library helpers
without stack information (libgcc's integer routines) are charged LIBGCC_FRAME bytes.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from mexc.errors import MexcError

LIBGCC_FRAME = 32
# bytes the Makefile's RAM check (runtime/board/ram_check.awk) keeps beside the stack bound for the
# exception frame of an interrupt (8 words pushed by the core, 4 bytes of alignment) and to spare
STACK_MARGIN = 64
_NODE = re.compile(r'node: \{ title: "([^"]+)" label: "[^"]*?(?:\\n(\d+) bytes \((\w+)\))?"')
_EDGE = re.compile(r'edge: \{ sourcename: "([^"]+)" targetname: "([^"]+)"')


@dataclass(frozen=True)
class McuSizes:
    text: int  # code and constants (.text includes .rodata in our linker script)
    data: int
    bss: int
    stack: int  # worst-case stack from the call graph

    @property
    def flash(self) -> int:
        return self.text + self.data

    @property
    def ram(self) -> int:
        return self.data + self.bss + self.stack


def section_sizes(elf: Path) -> dict[str, int]:
    out = subprocess.run(
        ["arm-none-eabi-size", "-A", str(elf)], capture_output=True, text=True, check=True
    ).stdout
    sizes: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith(".") and parts[1].isdigit():
            sizes[parts[0]] = int(parts[1])
    return sizes


def stack_bound(ci_files: list[Path], root: str = "Reset_Handler") -> int:
    graph = nx.DiGraph()
    frames: dict[str, int] = {}
    for path in ci_files:
        text = path.read_text()
        for name, size, kind in _NODE.findall(text):
            graph.add_node(name)
            if size:
                if kind != "static":
                    raise MexcError(
                        f"{name} has a {kind} stack frame; the MCU program needs static frames"
                    )
                frames[name] = max(frames.get(name, 0), int(size))
        for src, dst in _EDGE.findall(text):
            graph.add_edge(src, dst)
    if root not in graph:
        raise MexcError(f"no call graph entry for {root}")
    reach = graph.subgraph(nx.descendants(graph, root) | {root})
    if not nx.is_directed_acyclic_graph(reach):
        cycle = nx.find_cycle(reach)
        raise MexcError(f"recursion in the MCU program: {cycle}")
    best: dict[str, int] = {}
    for name in reversed(list(nx.topological_sort(reach))):
        own = frames.get(name, LIBGCC_FRAME)
        best[name] = own + max((best[c] for c in reach.successors(name)), default=0)
    return best[root]


def measure(project: Path, cpu: str = "cortex-m3") -> McuSizes:
    elf = project / f"train_{cpu}.elf"
    sizes = section_sizes(elf)
    stack = stack_bound(sorted(project.glob(f"train_{cpu}.elf-*.ci")))
    return McuSizes(sizes.get(".text", 0), sizes.get(".data", 0), sizes.get(".bss", 0), stack)
