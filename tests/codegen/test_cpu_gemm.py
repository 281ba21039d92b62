"""The host GEMM kernels of cpu_gemm (packs, the byte-product panels, the int32 tile, unpack)
give the exact integer product, at the extremes of the int8 range and at shapes that need every
kind of padding (odd rows, columns off the tile, K off a multiple of 4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

from mexc.backends.llvm.products import host_cpu
from mexc.lowering import gemm_forms as gf
from mexc.lowering import te_attention, te_ops
from mexc.lowering.cpu_gemm import (
    GEMM_KERNELS,
    TRANSPOSE_STRIDE,
    CpuGemm,
    cpu_gemm,
    schedule_parallel,
)

_HOST = host_cpu()
# every kernel this host can run: the AVX2 byte kernel on any host that picks a byte kernel
_RUNS = {"int32": True, "avx2_i8": _HOST.gemm_kernel != "int32", "vnni_i8": _HOST.vnni256}
KERNELS = [
    pytest.param(k, marks=pytest.mark.skipif(not _RUNS[k], reason=f"this host cannot run {k}"))
    for k in GEMM_KERNELS
]
BYTE_KERNELS = [p for p in KERNELS if p.values[0] != "int32"]


def _run(cg: CpuGemm, x: np.ndarray, y: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    ex = tvm.compile(cg.module(), target=host_cpu().target())
    t = tvm.runtime.tensor
    a = t(np.zeros(cg.a_shape, np.int8))
    b = t(np.zeros(cg.b_shape, np.int8))
    rows = t(np.zeros(cg.b_rows_shape, np.int8)) if cg.b_rows_shape else b
    c = t(np.zeros(cg.c_shape, np.int32))
    out = t(np.zeros(out_shape, np.int32))
    ex["pack_a"](t(x), a)
    ex["pack_b"](t(y), rows)
    if cg.interleave_b is not None:
        ex["interleave_b"](rows, b)
    ex["gemm"](a, b, c)
    ex["unpack"](c, out)
    return out.numpy()


def _operands(rng: np.random.Generator, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    """Random int8 mantissas in [-127, 127] with whole rows at the extremes, where the byte
    kernel's int16 pair sums are largest (2 * 127 * 127)."""
    out = []
    for shape in shapes:
        v = rng.integers(-127, 128, shape).astype(np.int8)
        v.reshape(-1, shape[-1])[0] = 127
        v.reshape(-1, shape[-1])[-1] = -127
        out.append(v)
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "n,k,o",
    # (256, 64, 64): 2 column panels, tasks of 4 row tiles; (512, 36, 8): 1 panel, 8 tiles
    [
        (16, 144, 40),
        (3, 7, 5),
        (5, 37, 40),
        (2, 1568, 10),
        (9, 4, 33),
        (1, 18, 8),
        (256, 64, 64),
        (512, 36, 8),
    ],
)
def test_linear_products_are_exact(kernel: str, n: int, k: int, o: int) -> None:
    assert kernel in GEMM_KERNELS
    x, w = _operands(np.random.default_rng(n * k + o), (n, k), (o, k))
    cg = cpu_gemm(gf.linear_forward("t", n, k, o), 8, kernel=kernel)
    want = x.astype(np.int64) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_run(cg, x, w, (n, o)), want)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("o", [72, 40])
def test_weight_gradients_transpose_dy_in_tiles_and_are_exact(kernel: str, o: int) -> None:
    """A linear weight gradient's A is dy transposed: 72 bytes apart (TRANSPOSE_STRIDE or
    more) its pack runs in 64-column tiles, 1280 / 64 = 20 parallel tasks; 40 apart, a row
    at a time."""
    rows, k = 1280, 40
    dy, x = _operands(np.random.default_rng(o), (rows, o), (rows, k))
    cg = cpu_gemm(gf.linear_grad_weight("t", rows, k, o), 8, kernel=kernel)
    assert ("T.parallel(20)" in cg.pack_a.script()) == (o >= TRANSPOSE_STRIDE)
    want = dy.astype(np.int64).T @ x.astype(np.int64)
    np.testing.assert_array_equal(_run(cg, dy, x, (o, k)), want)


def test_a_linear_accumulator_is_its_gemms_c_only_where_nothing_is_padded() -> None:
    """gemm_forms.c_is_out: the plan lets the GEMM write a linear layer's accumulator itself
    (no unpack) only where C has its layout."""
    plain = gf.linear_forward("t", 64, 32, 64)
    assert gf.c_is_out(plain, cpu_gemm(plain, 8).c_shape)
    padded = gf.linear_forward("t", 5, 32, 36)  # 36 columns padded to a 32-wide tile's 64
    assert not gf.c_is_out(padded, cpu_gemm(padded, 8).c_shape)
    transposed = dataclasses.replace(plain, out_at=lambda r, c: (0, c, r))
    assert not gf.c_is_out(transposed, (1, 64, 64))
    grouped = gf.batched_matmul("t", 2, 8, 16, 8)
    assert not gf.c_is_out(grouped, (2, 8, 8))


@pytest.mark.parametrize("kernel", BYTE_KERNELS)
@pytest.mark.parametrize("groups", [1, 3])
def test_transposed_products_are_exact_and_groups_keep_the_int32_tile(
    kernel: str, groups: int
) -> None:
    form = gf.batched_matmul("t", groups, 6, 18, 24, trans_a=True, trans_b=True)
    x, y = _operands(np.random.default_rng(5), (groups, 18, 6), (groups, 24, 18))
    cg = cpu_gemm(form, 8, kernel=kernel)
    # one group: three 8-column panels, K = 18 padded to 20; groups of 6 rows (fewer than
    # GROUPED_ROWS): rows, as the int32 tile
    assert cg.b_shape == ((1, 3, 5, 8, 4) if groups == 1 else (groups, 18, 24))
    want = np.einsum("gkm,gqk->gmq", x.astype(np.int64), y.astype(np.int64))
    np.testing.assert_array_equal(_run(cg, x, y, (groups, 6, 24)), want)


@pytest.mark.parametrize("kernel", BYTE_KERNELS)
@pytest.mark.parametrize("groups,k", [(3, 16), (8, 16), (3, 49)])
def test_attention_products_run_in_bytes_and_are_exact(kernel: str, groups: int, k: int) -> None:
    """Groups of GROUPED_ROWS rows or more (attention's q k^T, 49 tokens: odd rows, columns
    off the tile) take the byte kernel: 3 groups x 2 panels are too few for the GEMM to build
    them (an interleave kernel), 8 x 2 enough."""
    form = gf.batched_matmul("t", groups, 49, k, 49, trans_b=True)
    x, y = _operands(np.random.default_rng(groups + k), (groups, 49, k), (groups, 49, k))
    cg = cpu_gemm(form, 8, kernel=kernel)
    kp = -(-k // 4)
    built_in_gemm = groups * 2 >= 16
    assert cg.b_shape == ((groups, k, 64) if built_in_gemm else (groups, 2, kp, 32, 4))
    assert (cg.interleave_b is None) == built_in_gemm
    want = np.einsum("gmk,gqk->gmq", x.astype(np.int64), y.astype(np.int64))
    np.testing.assert_array_equal(_run(cg, x, y, (groups, 49, 49)), want)


@pytest.mark.parametrize("kernel", BYTE_KERNELS)
@pytest.mark.parametrize("k", [144, 37])
def test_panels_built_inside_the_gemm_are_exact(kernel: str, k: int) -> None:
    """With enough column panels for the GEMM's tasks (here 17 of 32 columns), each task
    builds its panel from B's rows: no interleave kernel, no panel copy of B."""
    n, o = 530, 6
    x, w = _operands(np.random.default_rng(k), (o, k), (n, k))
    cg = cpu_gemm(gf.linear_forward("t", o, k, n), 8, kernel=kernel)
    assert cg.interleave_b is None and cg.b_rows_shape is None and len(cg.b_shape) == 3
    want = x.astype(np.int64) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_run(cg, x, w, (o, n)), want)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k", [64, 37])
def test_one_column_products_are_dot_products_along_k(kernel: str, k: int) -> None:
    """q = 1 per group (a depthwise weight gradient): no column padding, K padded to 32."""
    form = gf.batched_matmul("t", 3, 9, k, 1, trans_a=True, trans_b=True)
    x, y = _operands(np.random.default_rng(k), (3, k, 9), (3, 1, k))
    cg = cpu_gemm(form, 8, kernel=kernel)
    assert cg.c_shape == (3, 9, 1) and cg.b_shape == (3, 64, 1)
    want = np.einsum("gkm,gqk->gmq", x.astype(np.int64), y.astype(np.int64))
    np.testing.assert_array_equal(_run(cg, x, y, (3, 9, 1)), want)


def test_kernel_and_lanes_are_checked() -> None:
    form = gf.linear_forward("t", 4, 8, 8)
    with pytest.raises(ValueError, match="not one of"):
        cpu_gemm(form, 8, kernel="vnni")
    with pytest.raises(ValueError, match="8 int32 lanes"):
        cpu_gemm(form, 16, kernel="avx2_i8")


@pytest.mark.parametrize(
    ("shape", "axes", "bands"),
    [
        ((2048, 64), (0,), True),  # a bias gradient of 2048 token rows
        ((128, 16, 48), (0, 1), True),  # two leading axes summed
        ((1000, 24), (0,), True),  # rows not a multiple of 16: 8 bands
        ((8, 128, 256), (0,), False),  # too few rows for bands
        ((64, 16, 9), (0, 2), False),  # the last axis summed: not a column reduction
    ],
)
def test_column_sums_run_in_bands_and_stay_exact(
    shape: tuple[int, ...], axes: tuple[int, ...], bands: bool
) -> None:
    func = schedule_parallel(te_ops.axis_sum(shape, axes, "s")).with_attr("global_symbol", "s")
    assert ("acc_rf" in func.script()) == bands
    x = np.random.default_rng(1).integers(-128, 128, shape).astype(np.int8)
    x.flat[::7] = 127  # long runs of one sign: sums far from zero
    keep = tuple(d for i, d in enumerate(shape) if i not in axes)
    dev = tvm.cpu()
    acc = tvm.runtime.empty(keep, "int32", dev)
    tvm.compile(func, target=host_cpu().target())(tvm.runtime.tensor(x, dev), acc)
    np.testing.assert_array_equal(acc.numpy(), x.astype(np.int64).sum(axis=axes))


@pytest.mark.parametrize(("rows", "d"), [(2048, 64), (96, 24), (33, 7), (16, 512)])
def test_a_fused_compactions_shift_reduces_in_lanes_and_stays_exact(rows: int, d: int) -> None:
    shift, _ = te_attention.ln_affine_compaction(rows, d, 8, True, "ln")
    lanes = d % 8 == 0 and d <= 256  # 7 columns: no width divides them; 512: LLVM vectorizes
    scheduled = schedule_parallel(shift)
    assert ("amax_rows_rf" in scheduled.script()) == lanes
    rng = np.random.default_rng(2)
    dev = tvm.cpu()
    inputs = [
        rng.integers(-127, 128, (rows, d)).astype(np.int8),
        np.array([-7], np.int32),
        rng.integers(-127, 128, (d,)).astype(np.int8),
        np.array([-6], np.int32),
        rng.integers(-127, 128, (d,)).astype(np.int8),
        np.array([-3], np.int32),
        np.array([11, 22], np.int64),
    ]
    results = []
    for func in (shift, scheduled):  # unscheduled: one loop nest, as written
        ex = tvm.compile(func.with_attr("global_symbol", "s"), target=host_cpu().target())
        s, e = tvm.runtime.empty((1,), "int32", dev), tvm.runtime.empty((1,), "int32", dev)
        ex(*[tvm.runtime.tensor(a, dev) for a in inputs], s, e)
        results.append((int(s.numpy()[0]), int(e.numpy()[0])))
    assert results[0] == results[1]
    assert results[0][0] > 0  # the sums need a shift: the max is a real one
