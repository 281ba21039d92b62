"""cuda.schedule.schedule_gpu's kernels: runs of elementwise blocks over one domain share a kernel
(`_elementwise_runs`), and a block that reads a run's result at another element starts a kernel
of its own. Bit-exactness of the merged kernels is the emulator's and the GPU check's
(test_cuda_step, bench/cuda_emulate.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm_ffi
from tvm import s_tir, te, tirx

from mexc.backends.cuda.schedule import (
    _elementwise_runs,
    _Splits,
    lower_kernels,
    promote_scratch,
    schedule_gpu,
)
from mexc.kernels.norm import _eps_fixed
from mexc.lowering import te_norm
from mexc.lowering.te_func import prim_func


def _names(sch: s_tir.Schedule, runs: list[list]) -> list[list[str]]:
    return [[sch.get(b).name_hint for b in run] for run in runs]


def test_a_chain_of_elementwise_stages_is_one_run_until_a_neighbour_is_read() -> None:
    n = 64
    x = te.placeholder((n,), "int32", name="x")
    a = te.compute((n,), lambda i: x[i] + 1, name="a")
    b = te.compute((n,), lambda i: a[i] * 2, name="b")
    c = te.compute((n,), lambda i: b[(i + 1) % n] - a[i], name="c")  # b's neighbour
    d = te.compute((n,), lambda i: c[i] + x[(i + 3) % n], name="d")  # x is no run's result
    k = te.reduce_axis((0, n), "k")
    total = te.compute((1,), lambda _: te.sum(d[k], axis=k), name="t")
    func, _ = promote_scratch(prim_func([x, total], "chain"))
    sch = s_tir.Schedule(func)
    runs = _elementwise_runs(sch, sch.get_child_blocks(sch.get_sblock("root")))
    assert _names(sch, runs) == [["a", "b"], ["c", "d"], ["t"]]
    _, kernels = lower_kernels({"chain": schedule_gpu(func)}, "sm_80")
    assert len(kernels["chain"]) == 3


def test_a_run_does_not_overwrite_what_an_earlier_block_read_elsewhere() -> None:
    n = 32
    x = te.placeholder((n,), "int32", name="x")
    a = te.compute((n,), lambda i: x[i] * 3, name="a")
    b = te.compute((n,), lambda i: a[(i + 1) % n], name="b")
    c = te.compute((n,), lambda i: b[i] + 1, name="c")
    func, _ = promote_scratch(prim_func([x, c], "war"))
    sch = s_tir.Schedule(func)
    runs = _elementwise_runs(sch, sch.get_child_blocks(sch.get_sblock("root")))
    assert _names(sch, runs) == [["a"], ["b", "c"]]


@pytest.mark.parametrize(("shape", "count"), [((128, 64, 256), 4), ((8, 16, 9), 3)])
def test_batch_norm_statistics_take_a_few_kernels_instead_of_thirty_seven(
    shape: tuple[int, int, int], count: int
) -> None:
    """te_norm.bn_var: the per-channel sum of squares (two reductions), then 1/sigma's 33
    per-channel stages (bit lengths, the divisions, 16 integer square-root steps), then e_c.
    Reductions of 64 or more terms are a kernel of their own (threads share them); a shorter
    one (8 samples) runs in the kernel of the per-channel stages after it."""
    func = te_norm.bn_var(shape, 4, _eps_fixed(1e-5), True, "n1_bn_var", False)
    func, scratch = promote_scratch(func)
    assert len(scratch) == 31
    _, kernels = lower_kernels({"n1_bn_var": schedule_gpu(func)}, "sm_80")
    blocks = [k.block[0] for k in kernels["n1_bn_var"]]
    assert len(blocks) == count and np.prod(blocks) > 0


def _guard_cases() -> dict[str, tirx.PrimFunc]:
    """Functions whose thread splits do and do not divide: a run of elementwise blocks over
    1000 elements, a lone one over 768, a whole tensor's maximum over 1000 terms (one output's
    block takes THREADS) and per-row sums of 100 terms (REDUCE_THREADS), and batch norm's
    statistics (a run of 33 per-channel stages over 9 channels)."""
    x = te.placeholder((1000,), "int32", name="x")
    a = te.compute((1000,), lambda i: x[i] + 1, name="a")
    b = te.compute((1000,), lambda i: a[i] * 2, name="b")
    k = te.reduce_axis((0, 1000), "k")
    top = te.compute((1,), lambda _: te.max(b[k], axis=k), name="top")
    y = te.placeholder((768,), "int32", name="y")
    z = te.compute((768,), lambda i: y[i] - 3, name="z")
    rows = te.placeholder((7, 100), "int32", name="rows")
    r = te.reduce_axis((0, 100), "r")
    sums = te.compute((7,), lambda i: te.sum(rows[i, r], axis=r), name="sums")
    norm = te_norm.bn_var((8, 9, 10), 4, _eps_fixed(1e-5), True, "bn", False)
    funcs = {
        "run_and_max": prim_func([x, top], "run_and_max"),
        "lone": prim_func([y, z], "lone"),
        "row_sums": prim_func([rows, sums], "row_sums"),
        "bn": norm,
    }
    return {name: promote_scratch(f)[0] for name, f in funcs.items()}


def test_late_bounds_checks_equal_tvms_predicated_split() -> None:
    """schedule_gpu splits its thread loops without TVM's predication (slow: cuda.schedule
    ._Splits) and writes the bounds check itself: the functions equal TVM's own, and a split
    that does not divide has its check (every block under the loop, once)."""
    for name, func in _guard_cases().items():
        ours, tvms = schedule_gpu(func), schedule_gpu(func, tvm_split=True)
        assert tvm_ffi.structural_equal(ours, tvms, map_free_vars=True), name
    text = schedule_gpu(_guard_cases()["run_and_max"]).script()
    assert text.count("T.where(") == 3  # a, b and the maximum's block
    assert "< 1000" in text and "T.where" not in schedule_gpu(_guard_cases()["lone"]).script()


def test_a_bounds_check_without_its_loop_gives_no_function() -> None:
    """A guard whose loop is not in the function (schedule_gpu then takes TVM's own split)."""
    func = _guard_cases()["lone"]
    splits = _Splits(s_tir.Schedule(func), tvm_split=False)
    v = tirx.Var("elsewhere", "int32")
    splits.guards.append((v, v < 5))
    assert splits.guarded(func) is None
