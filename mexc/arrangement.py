"""How a parameter the program holds rearranged maps to the model's own.

An op may hold a parameter in another layout than the model declares it: a Conv1d's weight as
a (O, C, 1, k) conv2d kernel, a Conv3d's as (kt O, C, kh, kw) conv2d kernels (tap-major), a
weight that `x @ w` or an einsum reads as [out, in]. The held tensor is the declared one seen as
`split`, permuted by `perm`, then seen as the held shape. The graph records every such
parameter in its attribute `arranged` (one string per parameter, so that the IR and a
checkpoint's program carry it), and Program.float_weights puts the held values back into the
model's shapes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

ATTR = "arranged"


class Arrangement(NamedTuple):
    declared: tuple[int, ...]  # the model's shape of the parameter
    split: tuple[int, ...]  # the declared tensor seen as this (same size) ...
    perm: tuple[int, ...]  # ... permuted so, then seen as the held shape

    def held(self, declared: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The held tensor of shape `shape` made from the declared one."""
        return np.asarray(declared).reshape(self.split).transpose(self.perm).reshape(shape)

    def declared_of(self, held: np.ndarray) -> np.ndarray:
        """The declared tensor the held one was made from."""
        moved = tuple(self.split[p] for p in self.perm)
        back = tuple(int(i) for i in np.argsort(self.perm))
        return np.asarray(held).reshape(moved).transpose(back).reshape(self.declared)

    def text(self, name: str) -> str:
        """`name declared split perm`, each a comma-separated list (the graph attribute's)."""
        dims = (",".join(map(str, t)) for t in (self.declared, self.split, self.perm))
        return " ".join((name, *dims))


def permutation(declared: tuple[int, ...], index: np.ndarray) -> Arrangement | None:
    """The arrangement whose held elements are declared.flat[index] (index in the held
    order), where the index is the declared tensor seen as some split, permuted (what views,
    reshapes and transposes of a parameter give: `w.reshape(4, 6).T`), else None. The held
    order's axes are read off the index from the innermost out (each a run of equal steps),
    and the result checked whole."""
    idx = np.asarray(index, np.int64).reshape(-1)
    size = idx.size
    if size != int(np.prod(declared, dtype=np.int64)) or size == 0 or idx[0] != 0:
        return None
    axes: list[tuple[int, int]] = []  # (extent, step in the declared order), innermost first
    block = 1
    while block < size:
        step = int(idx[block] - idx[0])
        k = 1
        while block * k < size and idx[block * k] - idx[0] == k * step:
            k += 1
        if size % (block * k):
            return None
        axes.append((k, step))
        block *= k
    held_axes = axes[::-1]  # outermost first
    by_step = sorted(range(len(held_axes)), key=lambda i: -held_axes[i][1])
    split = tuple(held_axes[i][0] for i in by_step)
    perm = tuple(by_step.index(i) for i in range(len(held_axes)))
    flat = np.arange(size).reshape(split).transpose(perm).reshape(-1)
    if not np.array_equal(flat, idx):
        return None
    return Arrangement(tuple(declared), split, perm)


def arrangements(graph: Any) -> dict[str, Arrangement]:
    """The rearranged parameters a graph records, by name."""
    out: dict[str, Arrangement] = {}
    for entry in graph.attr(ATTR, ()) or ():
        name, *dims = str(entry).rsplit(" ", 3)
        declared, split, perm = (tuple(int(d) for d in t.split(",") if d) for t in dims)
        out[name] = Arrangement(declared, split, perm)
    return out
