"""Static arena placement: offsets for buffers with known lifetimes, so that buffers whose
lifetimes do not overlap share bytes. One allocator for every planner: plan-memory (IR values)
and the launch-plan layout of the llvm and CUDA backends (plan_layout).

An item is (start, end, size, key): the buffer is live from position `start` to position `end`,
both inclusive. Placement tries several orders, each with first-fit and best-fit, and keeps the
smallest peak: a greedy placement's quality depends on the order, and none of the four orders
wins on every graph (measured on the example CNNs). Where the best of them still lies above the
live peak (the most bytes live at one position: no placement is lower), it is refined by
"squeaky wheel" rounds: the items that end above the live peak are moved earlier in the size
order and everything is placed again, with a few priority factors in turn (SmallResNet at
batch 128, 2026-12-07: its llvm plan 5.4 % above the live peak after the fixed orders and at
it after 2 rounds, its CUDA plan 7.6 % and 2.5 % after 37). Vectorized over the placed
items with numpy, so that plans of thousands of buffers (ResNet-18's launch plan) place in
about a second.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

Item = tuple[int, int, int, Hashable]  # start, end (inclusive), size in bytes, key

ORDERS: dict[str, Callable[[Item], tuple[int, int]]] = {
    "size": lambda it: (-it[2], it[0]),
    "start": lambda it: (it[0], -it[2]),
    "duration": lambda it: (-(it[1] - it[0]), -it[2]),
    "area": lambda it: (-(it[1] - it[0] + 1) * it[2], it[0]),
}


SQUEAKY_ROUNDS = 32  # refinement rounds at most (SmallResNet reaches its live peak in 7)
SQUEAKY_ITEMS = 200_000  # ... and at most this many item placements in all (large plans)
# priority factors of an item that ended above the live peak, tried in turn while the budget
# lasts. Measured on the llvm plans of ViTTiny, ViT-Ti, FashionCNN, DigitsCNN, SmallResNet and
# MobileNetV2Tiny at batch 128 (2026-12-02): with 1.5, ViTTiny ended 3.8 % and ViT-Ti 1.2 %
# above their live peaks; with 4, every one but MobileNetV2Tiny (0.26 %, as with 1.5) reaches
# it. On the C steps of the digits (batch 8) and Fashion (batch 4) CNNs 4 left 7.7 % and 8.6 %
# above the live peak, 2 reached it and 4.4 % (2026-12-03).
SQUEAKY_BOOSTS = (4.0, 2.0, 1.5)
# item placements for the factors after the first, all together: small plans (the C step's
# tens of buffers) try them fully, the launch plans of thousands of buffers hardly at all
SQUEAKY_EXTRA_ITEMS = 10_000


def _round_up(v: int, align: int) -> int:
    return (v + align - 1) // align * align


# live buffers up to this many are walked in Python, more with array operations (measured over
# the fixed orders of the example models' llvm and CUDA plans at batch 128, 2026-12-07: 6.3 s
# walking all of them, 3.2 s with arrays for all, 2.8 s with this split)
WALKED = 24


def _place(items: Sequence[Item], best_fit: bool, align: int) -> tuple[dict[Hashable, int], int]:
    """Place `items` in their order at the lowest (first fit) or the tightest (best fit)
    `align`-aligned free offset over each one's lifetime."""
    n = len(items)
    starts = np.empty(n, np.int64)
    ends = np.empty(n, np.int64)
    los = np.empty(n, np.int64)
    tops = np.empty(n, np.int64)  # each placed buffer's end, rounded up to `align`
    offsets: dict[Hashable, int] = {}
    peak = 0
    for i, (start, end, size, key) in enumerate(items):
        live = np.flatnonzero((starts[:i] <= end) & (ends[:i] >= start))
        chosen = 0
        if len(live):
            order = np.argsort(los[live], kind="stable")
            lo, top = los[live[order]], tops[live[order]]
            if len(live) <= WALKED:
                chosen = _walked(lo.tolist(), top.tolist(), size, best_fit)
            else:
                # the lowest free offset below each live buffer: above every one before it
                above = np.maximum.accumulate(top)
                free = np.concatenate(([0], above[:-1]))
                fits = np.flatnonzero(free + size <= lo)  # the gaps it fits
                if not len(fits):
                    chosen = int(above[-1])  # the open end above every live buffer
                elif best_fit:  # the tightest gap, the lowest of equal ones
                    chosen = int(free[fits[np.argmin(lo[fits] - free[fits])]])
                else:
                    chosen = int(free[fits[0]])
        starts[i], ends[i], los[i], tops[i] = start, end, chosen, _round_up(chosen + size, align)
        offsets[key] = chosen
        peak = max(peak, chosen + size)
    return offsets, peak


def _walked(lo: list[int], top: list[int], size: int, best_fit: bool) -> int:
    """_place's offset for a buffer of `size` among live buffers [lo, top) in the order of lo:
    a loop over them (fewer than WALKED: cheaper than the array operations' setup)."""
    free, chosen, tightest = 0, -1, -1
    for low, high in zip(lo, top):
        if free + size <= low:
            if not best_fit:
                return free
            if tightest < 0 or low - free < tightest:
                tightest, chosen = low - free, free
        free = max(free, high)
    return free if chosen < 0 else chosen


def place(items: Sequence[Item], align: int = 16) -> tuple[dict[Hashable, int], int]:
    """Offsets (multiples of `align`) for every item's key, and the arena's peak in bytes (the
    end of its highest buffer): the smallest over every order of ORDERS with first fit and with
    best fit."""
    if not items:
        return {}, 0
    orders = [sorted(items, key=key) for key in ORDERS.values()]
    results = [_place(order, best, align) for order in orders for best in (False, True)]
    best = min(results, key=lambda r: r[1])
    return _refined(items, best, align)


def live_bytes(items: Sequence[Item], align: int = 1) -> np.ndarray:
    """The bytes (sizes rounded up to `align`) live at each position from 0 to the last end."""
    if not items:
        return np.zeros(0, np.int64)
    delta = np.zeros(max(it[1] for it in items) + 2, np.int64)
    for start, end, size, _ in items:
        delta[start] += _round_up(size, align)
        delta[end + 1] -= _round_up(size, align)
    return np.cumsum(delta)[:-1]


def live_peak(items: Sequence[Item], align: int = 1) -> int:
    """The most bytes (sizes rounded up to `align`) live at one position: no placement of the
    items has a lower peak."""
    live = live_bytes(items, align)
    return int(live.max()) if len(live) else 0


def _refined(
    items: Sequence[Item], best: tuple[dict[Hashable, int], int], align: int
) -> tuple[dict[Hashable, int], int]:
    """`best` improved by squeaky-wheel rounds (first fit in a priority order that starts as
    the size order): after each, the items that end above the live peak have their priority
    raised, so that the next round places them before the ones that pushed them up.
    Deterministic: no randomness, a fixed number of rounds."""
    bound = live_peak(items, align)
    extra = SQUEAKY_EXTRA_ITEMS // len(items)  # rounds for the factors after the first
    for k, boost in enumerate(SQUEAKY_BOOSTS):
        if k == 0:
            rounds = min(SQUEAKY_ROUNDS, SQUEAKY_ITEMS // len(items))
        else:
            rounds = min(SQUEAKY_ROUNDS, extra)
            extra -= rounds
        priority = {it[3]: float(it[2]) for it in items}
        for _ in range(rounds):
            if best[1] <= bound:
                return best
            order = sorted(items, key=lambda it: (-priority[it[3]], it[0]))
            offsets, peak = _place(order, False, align)
            if peak < best[1]:
                best = offsets, peak
            for _, _, size, key in items:
                if offsets[key] + size > bound:
                    priority[key] *= boost
    return best


def overlaps(items: Sequence[Item], offsets: Mapping[Any, int]) -> list[tuple[Hashable, Hashable]]:
    """Pairs of items that are live at the same time and share bytes (empty for a valid
    placement): the check tests and the layout loader run."""
    bad = []
    ordered = sorted(items, key=lambda it: it[0])
    for i, (_, e1, z1, k1) in enumerate(ordered):
        for s2, _, z2, k2 in ordered[i + 1 :]:
            if s2 > e1:
                break
            o1, o2 = offsets[k1], offsets[k2]
            if z1 and z2 and o1 < o2 + z2 and o2 < o1 + z1:
                bad.append((k1, k2))
    return bad
