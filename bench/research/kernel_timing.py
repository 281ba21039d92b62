"""Shared by the kernel micro-benchmarks: the compiled step's threading and a best-of timer.

Importing `mexc.backends.llvm.step` sizes TVM's thread pool to every usable CPU, as the
compiled training step runs; without it TVM starts hardware_concurrency / 2 threads, one on this
two-core machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mexc.backends.llvm.step  # noqa: F401  (sets TVM_NUM_THREADS to the usable CPUs)


def best_seconds(fn: Callable[..., Any], args: list, repeats: int) -> float:
    """The fastest of `repeats` calls of fn(*args), after one warm-up call."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best
