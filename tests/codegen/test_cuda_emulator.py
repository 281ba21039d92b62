"""The CPU emulator of TVM's CUDA (mexc.backends.cuda.emulator): its CUDA built-ins on hand-written
kernels in TVM's style, against numpy. The whole-step check is in test_cuda_step.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from mexc.backends.cuda.emulator import EmulatedModule, _allocate, guards_intact

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

# TVM's two-stage cross-thread sum: shuffles within each warp, one value per warp through
# shared memory, shuffles again, thread 0 writes the block's sum
BLOCK_SUM = """
extern "C" __global__ void __launch_bounds__(128) block_sum(int* __restrict__ x,
                                                            int* __restrict__ out) {
  __shared__ alignas(64) int staging[4];
  __shared__ alignas(64) int result[1];
  int v = x[blockIdx.x * 128 + threadIdx.x];
  uint mask = 0xffffffffu;  // the build writes the mask in (cuda.source)
  for (int d = 16; d > 0; d >>= 1) v += __shfl_down_sync(mask, v, d, 32);
  if ((threadIdx.x % 32) == 0) staging[threadIdx.x >> 5] = v;
  __syncthreads();
  int w = 0;
  if (threadIdx.x < 4) w = staging[threadIdx.x];
  w += __shfl_down_sync(mask, w, 2, 32);
  w += __shfl_down_sync(mask, w, 1, 32);
  if (threadIdx.x == 0) ((volatile int*)result)[0] = w;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = ((volatile int*)result)[0];
}
"""

# one warp: C (16 x 16, int32) = A (16 x 32, row-major) . B^T with B stored (16 x 32) as (q, k)
WMMA_GEMM = """
extern "C" __global__ void __launch_bounds__(32) gemm(signed char* a, signed char* b, int* c) {
  using namespace nvcuda;
  wmma::fragment<wmma::accumulator, 16, 16, 16, int> acc[1];
  wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> fa[1];
  wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> fb[1];
  nvcuda::wmma::fill_fragment(acc[0], 0);
  for (int k = 0; k < 2; ++k) {
    nvcuda::wmma::load_matrix_sync(fa[0], (&(a[k * 16])), 32);
    nvcuda::wmma::load_matrix_sync(fb[0], (&(b[k * 16])), 32);
    nvcuda::wmma::mma_sync(acc[0], fa[0], fb[0], acc[0]);
  }
  nvcuda::wmma::store_matrix_sync((&(c[0])), acc[0], 16, nvcuda::wmma::mem_row_major);
}
"""

DP4A = """
extern "C" __global__ void __launch_bounds__(64) dot4(int* a, int* b, int* c, int* out) {
  int i = blockIdx.x * 64 + threadIdx.x;
  out[i] = __dp4a(a[i], b[i], c[i]);
}
"""

# each thread publishes its id, then reads its neighbour's: a race without the first barrier
NEIGHBOUR = """
extern "C" __global__ void __launch_bounds__(64) racy(int* __restrict__ out) {
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x + 1;
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
  __syncthreads();
  s[threadIdx.x] = 0;
}
extern "C" __global__ void __launch_bounds__(64) ordered(int* __restrict__ out) {
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x + 1;
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
  __syncthreads();
  s[threadIdx.x] = 0;
}
extern "C" __global__ void __launch_bounds__(4) past_end(int* __restrict__ x) {
  x[threadIdx.x + 1] = 7;
}
"""


@pytest.mark.parametrize("reverse", [False, True])
def test_cross_thread_sum_with_shuffles_and_barriers(reverse: bool) -> None:
    x = np.random.default_rng(0).integers(-(2**20), 2**20, (5, 128)).astype(np.int32)
    out = np.zeros(5, np.int32)
    EmulatedModule(BLOCK_SUM).launch("block_sum", (5, 1, 1), (128, 1, 1), [x, out], reverse)
    np.testing.assert_array_equal(out, x.sum(axis=1))


def test_wmma_tile_is_an_exact_int8_product() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    b = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    c = np.zeros((16, 16), np.int32)
    EmulatedModule(WMMA_GEMM).launch("gemm", (1, 1, 1), (32, 1, 1), [a, b, c])
    np.testing.assert_array_equal(c, a.astype(np.int32) @ b.astype(np.int32).T)


def test_dp4a_sums_four_signed_byte_products() -> None:
    rng = np.random.default_rng(2)
    a, b = (rng.integers(-128, 128, (128, 4)).astype(np.int8) for _ in range(2))
    c = rng.integers(-(2**30), 2**30, 128).astype(np.int32)
    out = np.zeros(128, np.int32)
    words = [np.ascontiguousarray(v).view(np.int32).reshape(-1) for v in (a, b)]
    EmulatedModule(DP4A).launch("dot4", (2, 1, 1), (64, 1, 1), [*words, c, out])
    expect = (a.astype(np.int64) * b).sum(axis=1) + c
    np.testing.assert_array_equal(out, expect.astype(np.int32))


def test_reverse_order_exposes_a_missing_barrier() -> None:
    mod = EmulatedModule(NEIGHBOUR)
    results = {}
    for kernel in ("racy", "ordered"):
        for reverse in (False, True):
            out = np.zeros(64, np.int32)
            mod.launch(kernel, (1, 1, 1), (64, 1, 1), [out], reverse)
            results[kernel, reverse] = out
    expect = (np.arange(64) + 1) % 64 + 1
    np.testing.assert_array_equal(results["ordered", False], expect)
    np.testing.assert_array_equal(results["ordered", True], expect)
    # forward, every thread but the last reads before its neighbour writes; reverse, the opposite
    assert results["racy", False].tolist() == [0] * 63 + [1]
    assert results["racy", True].tolist() == expect[:63].tolist() + [0]


def test_guard_bytes_catch_a_write_past_the_end() -> None:
    man = {"buffers": {"x": [[4], "int32"], "y": [[4], "int32"]}, "constants": {}, "views": {}}
    t, raw = _allocate(man)
    mod = EmulatedModule(NEIGHBOUR)
    mod.launch("past_end", (1, 1, 1), (3, 1, 1), [t["y"]])
    assert guards_intact(raw["y"]) and t["y"].tolist() == [0, 7, 7, 7]
    mod.launch("past_end", (1, 1, 1), (4, 1, 1), [t["x"]])
    assert not guards_intact(raw["x"])
