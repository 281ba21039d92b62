"""The one way every TE kernel of mexc becomes a PrimFunc."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

import tvm
from tvm import s_tir, te, tirx

from mexc.lowering.te_divide import lower_divisions

P = ParamSpec("P")
R = TypeVar("R")

# while trial_kernels() is active: (a trial_cached maker, its key) -> what it made (prim_func
# is one, keyed by its name and argument shapes)
_TRIALS: ContextVar[dict[Hashable, Any] | None] = ContextVar("mexc_trial_kernels", default=None)


@contextmanager
def trial_kernels() -> Iterator[None]:
    """Within it, prim_func returns the PrimFunc it made before under the same name and
    argument shapes instead of making it again. For the plan searches' trial builds
    (step_plan.build_plan): they read a plan's buffers and launch arguments, never its
    kernels, and making the PrimFuncs was most of their time (FashionCNN's 20 trial builds:
    9 of 18 s), and `trial_cached` kernel makers return what they made before too. A kernel
    of the same name and shapes may differ in its body (another lean level's constants), so a
    plan that will run is built outside."""
    token = _TRIALS.set({})
    try:
        yield
    finally:
        _TRIALS.reset(token)


def trial_cached(
    key: Callable[..., Hashable] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A kernel maker that, within trial_kernels(), returns what it made before for arguments
    of the same `key(*args)` (default: the arguments themselves, where all are values). For
    makers whose work beyond their PrimFuncs (schedules, TE expressions) costs more than the
    PrimFuncs themselves (a host GEMM's four scheduled kernels: 10 ms; a batch norm's TE
    stages). The key must hold everything the plan's buffers and launch arguments depend on:
    names and shapes, as prim_func's does."""

    def wrap(make: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(make)
        def cached(*args: P.args, **kwargs: P.kwargs) -> R:
            trials = _TRIALS.get()
            if trials is None:
                return make(*args, **kwargs)
            of = key(*args, **kwargs) if key else (args, tuple(sorted(kwargs.items())))
            k = (make.__module__, make.__qualname__, of)
            if k not in trials:
                trials[k] = make(*args, **kwargs)
            return trials[k]

        return cached

    return wrap


def _trial_key(args: list[te.Tensor], name: str) -> Hashable:
    """`name` and each argument's shape (a scalar Var: its name) and dtype."""
    shapes = tuple(
        (tuple(map(_dim, a.shape)), a.dtype) if isinstance(a, te.Tensor) else (str(a), "")
        for a in args
    )
    return name, shapes


def _dim(d: Any) -> int | str:
    """An extent as a key: its value where it is a constant (printing one costs 10 us)."""
    return d.value if isinstance(d, tirx.IntImm) else str(d)


@trial_cached(_trial_key)
def prim_func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    """The PrimFunc of `args` (inputs, then outputs) named `name`: integer divisions lowered
    (te_divide) and every Let variable defined once. The hash stages bind their inputs with
    Lets (te_compaction.mix32), and an expression that reuses a hashed value (a branch-free
    select reads both sides twice) repeats the same Let; ConvertSSA renames the copies.
    Within trial_kernels(), the one made before under the same name and argument shapes."""
    func = lower_divisions(te.create_prim_func(args))
    mod = tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))
    return mod["main"].with_attr("global_symbol", name)


def a_row_at_a_time(func: tirx.PrimFunc, out: str, after: tuple[str, ...] = ()) -> tirx.PrimFunc:
    """`func` with every block that `out` reads, directly or not, computed inside `out`'s outer
    loop, and that loop in parallel (a host schedule for kernels of many short rows, such as
    the row softmax). A row's intermediates stay in a scratch row in L1 instead of whole
    tensors, and the thread pool starts once, not once per block. `after`: blocks after
    `out`, over the same rows, that read those intermediates (computed in the loop too)."""
    sch = s_tir.Schedule(func)
    target = sch.get_sblock(out)
    row = sch.get_loops(target)[0]
    if after:  # one row loop for every consumer of the intermediates
        row = sch.merge(row, *(sch.get_loops(sch.get_sblock(name))[0] for name in after))
    needed: set[str] = set()
    todo = [target]
    while todo:
        for producer in sch.get_producers(todo.pop()):
            name = sch.get(producer).name_hint
            if name not in needed:
                needed.add(name)
                todo.append(producer)
    blocks = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    for name in reversed(blocks[: blocks.index(out)]):
        if name in needed:
            sch.compute_at(sch.get_sblock(name), row)
    sch.parallel(row)
    return sch.mod["main"]
