"""cuda.schedule.schedule_gpu's kernels: runs of elementwise blocks over one domain share a kernel
(`_elementwise_runs`), and a block that reads a run's result at another element starts a kernel
of its own. Bit-exactness of the merged kernels is the emulator's and the GPU check's
(test_cuda_step, bench/cuda_emulate.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import s_tir, te

from mexc.backends.cuda.schedule import (
    _elementwise_runs,
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
