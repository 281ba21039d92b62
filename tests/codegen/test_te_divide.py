"""Integer-only division in TIR: the llvm build equals numerics.idiv_round, and the CUDA build of
the same TIR has no floating-point instruction (nvcc's own division would use a reciprocal)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import tvm
from hypothesis import given
from hypothesis import strategies as st
from test_cuda_products import needs_cuda_tools
from tvm import te

from mexc.backends.cuda.nvcc import compile_cubin, float_opcodes, sass_opcodes
from mexc.backends.cuda.products import cuda_source
from mexc.backends.cuda.runtime import ARCHS
from mexc.backends.cuda.schedule import schedule_gpu
from mexc.lowering.te_divide import idiv_round, isqrt, lower_divisions
from mexc.numerics import idiv_round as ref_idiv_round
from mexc.numerics import isqrt as ref_isqrt

N = 64
MAX = 2**31 - 1


def _division_func(native: bool = False) -> tvm.tirx.PrimFunc:
    a = te.placeholder((N,), "int32", name="a")
    b = te.placeholder((N,), "int32", name="b")
    q = te.compute((N,), lambda i: idiv_round(a[i], b[i], native).astype("int32"), name="q")
    return lower_divisions(te.create_prim_func([a, b, q])).with_attr("global_symbol", "div")


@cache
def _built(native: bool) -> tvm.runtime.Module:
    return tvm.compile(_division_func(native), target="llvm")


def _check(a: list[int], b: list[int]) -> None:
    for native in (False, True):  # the long division, and the host's integer divide
        _check_one(a, b, native)


def _check_one(a: list[int], b: list[int], native: bool) -> None:
    av = np.zeros(N, np.int32)
    bv = np.ones(N, np.int32)
    av[: len(a)], bv[: len(b)] = a, b
    dev = tvm.cpu()
    q = tvm.runtime.empty((N,), "int32", dev)
    _built(native)(tvm.runtime.tensor(av, dev), tvm.runtime.tensor(bv, dev), q)
    np.testing.assert_array_equal(q.numpy(), ref_idiv_round(av, bv))


EDGE_A = [0, 1, -1, 2, -2, 3, -3, 5, -5, 7, -7, MAX, -MAX, MAX - 1, -(2**30), 2**30, 12345]
EDGE_B = [1, 2, 3, 7, 10, 2**16, 2**30, MAX - 1, MAX]


@pytest.mark.parametrize("b", EDGE_B)
def test_edge_operands(b: int) -> None:
    # odd multiples of b / 2 (exact ties for even b) and their neighbours, both signs
    halves = [k * b // 2 for k in (1, 3, 2**20 + 1) if k * b // 2 <= MAX]
    near = [v for h in halves for v in (h, -h, h - 1, 1 - h, h + 1, -h - 1) if abs(v) <= MAX]
    a = (EDGE_A + near)[:N]
    _check(a, [b] * len(a))


@given(
    st.lists(
        st.tuples(st.integers(-MAX, MAX), st.integers(1, MAX) | st.integers(1, 300)),
        min_size=1,
        max_size=N,
    )
)
def test_matches_reference(pairs: list[tuple[int, int]]) -> None:
    _check([p[0] for p in pairs], [p[1] for p in pairs])


@needs_cuda_tools
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_division_has_no_float(arch: str, tmp_path: Path) -> None:
    func = schedule_gpu(_division_func()).with_attr("global_symbol", "div")
    cu = tmp_path / "div.cu"
    cu.write_text(cuda_source({"div": func}, arch))
    kernels = sass_opcodes(compile_cubin(cu, arch, tmp_path / "div.cubin"))
    assert set(kernels) == {"div_kernel"}
    assert not float_opcodes(kernels["div_kernel"])


@cache
def _built_isqrt() -> tvm.runtime.Module:
    n = te.placeholder((N,), "int64", name="n")
    r = te.compute((N,), lambda i: isqrt(n[i]), name="r")
    func = lower_divisions(te.create_prim_func([n, r])).with_attr("global_symbol", "isqrt")
    return tvm.compile(func, target="llvm")


ISQRT_EDGE = [0, 1, 2, 3, 4, 8, 15, 16, 17, 2**31, 2**32 - 1, 2**32, 2**61, 2**62 - 1]
ISQRT_EDGE += [k * k + d for k in (3, 46341, 2**30, 2**31 - 1) for d in (-1, 0, 1)]


@given(st.lists(st.integers(0, 2**62 - 1), min_size=1, max_size=N - len(ISQRT_EDGE)))
def test_isqrt_matches_reference(values: list[int]) -> None:
    """The isqrt placeholder's digit-by-digit loop (AdamW's root, numerics 12b step 4) against
    numerics.isqrt over 0 <= n < 2^62: squares, their neighbours and random values."""
    nv = np.zeros(N, np.int64)
    edge = [v for v in ISQRT_EDGE if 0 <= v < 2**62]
    nv[: len(edge) + len(values)] = edge + values
    dev = tvm.cpu()
    out = tvm.runtime.empty((N,), "int64", dev)
    _built_isqrt()(tvm.runtime.tensor(nv, dev), out)
    np.testing.assert_array_equal(out.numpy(), ref_isqrt(nv))
