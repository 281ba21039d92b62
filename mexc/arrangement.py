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
    shape) where that is a permutation of the declared axes, else None."""
    import itertools

    flat = np.arange(int(np.prod(declared, dtype=np.int64))).reshape(declared)
    wanted = np.asarray(index).reshape(-1)
    for perm in itertools.permutations(range(len(declared))):
        if np.array_equal(flat.transpose(perm).reshape(-1), wanted):
            return Arrangement(tuple(declared), tuple(declared), tuple(perm))
    return None


def arrangements(graph: Any) -> dict[str, Arrangement]:
    """The rearranged parameters a graph records, by name."""
    out: dict[str, Arrangement] = {}
    for entry in graph.attr(ATTR, ()) or ():
        name, *dims = str(entry).rsplit(" ", 3)
        declared, split, perm = (tuple(int(d) for d in t.split(",") if d) for t in dims)
        out[name] = Arrangement(declared, split, perm)
    return out
