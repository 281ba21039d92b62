"""Splitting kernel compilation over the CPUs: TVM lowers and compiles a module on one thread,
and a step's kernels are independent."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")
_SHARED: dict[str, Any] = {}  # what forked workers read (inherited: TVM objects do not pickle)


def split_symbols(symbols: list[str], per_worker: int) -> list[list[str]]:
    """`symbols` dealt round-robin over as many workers as there are CPUs, each with at least
    `per_worker` symbols (one list when there are few)."""
    n = max(1, min(len(os.sched_getaffinity(0)), len(symbols) // per_worker or 1))
    ordered = sorted(symbols)
    return [ordered[i::n] for i in range(n)]


def _call(task: tuple[Callable[..., Any], Any]) -> Any:
    fn, job = task
    return fn(job, _SHARED)


def forked_map(fn: Callable[[Any, dict[str, Any]], R], jobs: list[Any], shared: dict) -> list[R]:
    """[fn(job, shared) for job in jobs], one forked worker process per job (in this process
    when there is one job). `fn` must be a module-level function."""
    _SHARED.update(shared)
    try:
        if len(jobs) == 1:
            return [fn(jobs[0], _SHARED)]
        with multiprocessing.get_context("fork").Pool(len(jobs)) as pool:
            return pool.map(_call, [(fn, job) for job in jobs])
    finally:
        _SHARED.clear()
