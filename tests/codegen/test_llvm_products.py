"""Product kernels compiled by TVM for the host CPU: exact against numpy; feature detection."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest
from product_refs import all_cases, rand_int8, reference

from mexc.backends.llvm.products import compile_product, host_cpu, parse_cpuinfo
from mexc.lowering import te_products

CASES = all_cases()
BUILDERS = {**te_products.CONV_PRODUCTS, **te_products.LINEAR_PRODUCTS}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_llvm_exact(case: tuple) -> None:
    prod, cid, args = case
    fn = compile_product(BUILDERS[prod](*args, name=f"{prod}__{cid}"))
    rng = np.random.default_rng(zlib.crc32(f"{prod}{cid}".encode()))
    a, b = rand_int8(rng, fn.inputs[0].shape), rand_int8(rng, fn.inputs[1].shape)
    np.testing.assert_array_equal(fn(a, b).astype(np.int64), reference(prod, args, a, b))


def test_llvm_rejects_bad_input() -> None:
    fn = compile_product(te_products.linear_acc(2, 3, 4))
    with pytest.raises(ValueError, match="int8"):
        fn(np.zeros((2, 3), np.int32), np.zeros((4, 3), np.int8))
    with pytest.raises(ValueError, match="int8"):
        fn(np.zeros((3, 2), np.int8), np.zeros((4, 3), np.int8))


def test_parse_cpuinfo() -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu sse4_2 avx2 fma avx512f avx512bw avx512_vnni\n"
    cpu = parse_cpuinfo(x86, "x86_64")
    assert cpu.vnni and cpu.lanes32 == 16
    assert "+avx512vnni" in [str(a) for a in cpu.target().attrs["mattr"]]
    # vpdpbusd on 256-bit panels needs VL (or AVX-VNNI); else the AVX2 byte kernel
    assert (cpu.gemm_kernel, cpu.gemm_lanes) == ("avx2_i8", 8)
    assert parse_cpuinfo(x86.replace("avx512bw", "avx512bw avx512vl"), "x86_64").gemm_kernel == (
        "vnni_i8"
    )
    avx_vnni = parse_cpuinfo("flags\t: avx2 avx_vnni\n", "x86_64")
    assert (avx_vnni.gemm_kernel, avx_vnni.gemm_lanes) == ("vnni_i8", 8)
    assert "+avxvnni" in [str(a) for a in avx_vnni.target().attrs["mattr"]]
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp\n"
    cpu = parse_cpuinfo(arm, "aarch64")
    assert not cpu.vnni and cpu.lanes32 == 4
    assert "+dotprod" in [str(a) for a in cpu.target().attrs["mattr"]]
    assert parse_cpuinfo("", "x86_64").lanes32 == 4


def test_timing_print(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a speed requirement: prints TVM vs numpy int64 vs float32 BLAS for one GEMM."""
    n, k, o = 64, 256, 64
    t0 = time.perf_counter()
    fn = compile_product(te_products.linear_acc(n, k, o))
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    x, w = rand_int8(rng, (n, k)), rand_int8(rng, (o, k))

    def best(f) -> float:
        f()
        return min(_timed(f) for _ in range(5)) * 1e3

    t_tvm = best(lambda: fn(x, w))
    t_np = best(lambda: x.astype(np.int64) @ w.astype(np.int64).T)
    xf, wf = x.astype(np.float32), w.astype(np.float32)
    t_f32 = best(lambda: xf @ wf.T)
    assert np.array_equal(fn(x, w), (xf @ wf.T).astype(np.int32))
    with capsys.disabled():
        print(
            f"\nlinear_acc {n}x{k}x{o} ({host_cpu().target().attrs.get('mattr')}): compile "
            f"{compile_s:.2f} s, tvm {t_tvm:.3f} ms, numpy int64 {t_np:.3f} ms, "
            f"float32 BLAS {t_f32:.3f} ms"
        )


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t
