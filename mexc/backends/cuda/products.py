"""CUDA product kernels: the GEMM forms of `gemm_forms` scheduled for NVIDIA GPUs with TVM.

Two GEMM schedules (`GEMM_SCHEDULES`, chosen by MEXC_CUDA_GEMM, default "imma"):

- `schedule_gemm_imma`: int8 tensor cores through TVM's WMMA intrinsics (16x16x16 s8 x s8 -> s32,
  SASS `IMMA.16816.S8.S8`), a 64x64 block tile of 4 warps with 2x2 fragments each, A and B staged
  in shared memory. A hand schedule: TVM's dlight `MatmulInt8Tensorization` took 114 s to lower
  one 256x512x576 GEMM here (docs/cuda.md), this one milliseconds.
- `schedule_gemm_dp4a`: `__dp4a` (four int8 products into int32 per instruction, SASS
  `IDP.4A.S8.S8`), a 64x64 block tile of 16x16 threads with 4x4 register tiles, the innermost 4
  K-values tensorized into one `__dp4a` with the accumulator passed in.

`schedule_product` schedules one product's gathers (`pack_a`, `pack_b`, `unpack`, one thread per
element) and its GEMM with dp4a; the ViT's product-only build uses it (cuda_build). TVM only
emits CUDA source here (no GPU); `mexc.backends.cuda.nvcc` turns it into cubins for sm_80 and sm_90.
"""

from __future__ import annotations

import os

from tvm import s_tir, tirx
from tvm.script import tirx as T

from mexc.backends.cuda.schedule import lower_kernels, schedule_gpu
from mexc.lowering import tvmscript_stack
from mexc.lowering.gemm_forms import TILE_K, TILE_MQ, GemmFuncs

TILE_T = 4  # per-thread register tile (TILE_T x TILE_T outputs)
THREADS_2D = TILE_MQ // TILE_T  # 16 x 16 threads per GEMM block
DP4A_INTRIN = "mexc_dp4a_s8s8s32_acc"


# the @T.prim_func below run at import: TVMScript's stack walk made cheap first
tvmscript_stack.install()


@T.prim_func(s_tir=True)
def _dp4a_desc(
    a: T.Buffer((4,), "int8", offset_factor=1, align=4, scope="shared"),  # type: ignore[valid-type]
    b: T.Buffer((4,), "int8", offset_factor=1, align=4, scope="shared"),  # type: ignore[valid-type]
    c: T.Buffer((1,), "int32", offset_factor=1, align=4, scope="local"),  # type: ignore[valid-type]
) -> None:
    with T.sblock("root"):
        T.reads(c[0], a[0:4], b[0:4])
        T.writes(c[0])
        for i in range(4):
            with T.sblock("update"):
                vi = T.axis.remap("R", [i])
                c[0] = c[0] + T.cast(a[vi], "int32") * T.cast(b[vi], "int32")


@T.prim_func(s_tir=True)
def _dp4a_impl(
    a: T.Buffer((4,), "int8", offset_factor=1, align=4, scope="shared"),  # type: ignore[valid-type]
    b: T.Buffer((4,), "int8", offset_factor=1, align=4, scope="shared"),  # type: ignore[valid-type]
    c: T.Buffer((1,), "int32", offset_factor=1, align=4, scope="local"),  # type: ignore[valid-type]
) -> None:
    with T.sblock("root"):
        T.reads(c[0], a[0:4], b[0:4])
        T.writes(c[0])
        # the accumulator goes into __dp4a itself (one instruction, no separate add)
        c[0] = T.call_pure_extern(
            "__dp4a", a.vload([0], "int8x4"), b.vload([0], "int8x4"), c[0], dtype="int32"
        )


def _register_dp4a() -> None:
    try:
        s_tir.TensorIntrin.get(DP4A_INTRIN)
    except Exception:  # noqa: BLE001 - TVM raises its own error type when absent
        s_tir.TensorIntrin.register(DP4A_INTRIN, _dp4a_desc, _dp4a_impl)


def _cooperative_fetch(sch: s_tir.Schedule, cached: s_tir.SBlockRV) -> None:
    """Let the 16x16 threads of the block load a shared tile together, 4 int8 per thread."""
    loops = sch.get_loops(cached)
    inner = sch.fuse(*loops[-2:])
    _, ty, tx, vec = sch.split(inner, [None, THREADS_2D, THREADS_2D, 4])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)


def schedule_gemm_dp4a(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The padded batched NT GEMM with dp4a; extents must be multiples of TILE_MQ / TILE_K."""
    _register_dp4a()
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("c")
    g, m, q, k = sch.get_loops(blk)
    m0, m1, m2 = sch.split(m, [None, THREADS_2D, TILE_T])
    q0, q1, q2 = sch.split(q, [None, THREADS_2D, TILE_T])
    k0, k1, k2 = sch.split(k, [None, TILE_K // 4, 4])
    sch.reorder(g, m0, q0, m1, q1, k0, k1, m2, q2, k2)
    sch.bind(g, "blockIdx.z")
    sch.bind(m0, "blockIdx.y")
    sch.bind(q0, "blockIdx.x")
    sch.bind(m1, "threadIdx.y")
    sch.bind(q1, "threadIdx.x")
    local = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(local, q1)
    for index in (0, 1):
        shared = sch.cache_read(blk, index, "shared")
        sch.compute_at(shared, k0)
        _cooperative_fetch(sch, shared)
    sch.decompose_reduction(blk, k0)
    sch.tensorize(k2, DP4A_INTRIN)
    return sch.mod["main"]


WARP = 32
IMMA_TILE = 16  # the 16x16x16 int8 WMMA fragment (SASS IMMA.16816.S8.S8)
IMMA_WARPS = 2  # warps per block along M and along Q (4 warps)
IMMA_FRAGMENTS = 2  # fragments per warp along M and along Q: a warp owns 32x32 outputs


def _fetch_shared(sch: s_tir.Schedule, block: s_tir.SBlockRV, vector: int) -> None:
    """The block's 4 warps load a shared tile together, `vector` int8 per thread per step."""
    inner = sch.fuse(*sch.get_loops(block)[-2:])
    _, ty, tz, tx, vec = sch.split(inner, [None, IMMA_WARPS, IMMA_WARPS, WARP, vector])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tz, "threadIdx.z")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)


def _fragments(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> s_tir.LoopRV:
    """Split a fragment copy's last two loops into 16x16 tiles; returns the tile's first loop."""
    i, j = sch.get_loops(block)[-2:]
    i0, i1 = sch.split(i, [None, IMMA_TILE])
    j0, j1 = sch.split(j, [None, IMMA_TILE])
    sch.reorder(i0, j0, i1, j1)
    return i1


def schedule_gemm_imma(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The padded batched NT GEMM on int8 tensor cores (WMMA 16x16x16, s8 x s8 -> s32): a block
    computes a 64x64 tile of C with 4 warps, each warp 2x2 fragments accumulated in registers
    over K; A and B tiles of 16 or 32 K-values are staged in shared memory (rows padded against
    bank conflicts) and loaded into fragments, B as column-major (it is stored (q, k))."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("c")
    g, m, q, k = sch.get_loops(blk)
    kp = int(sch.get(k).extent)
    k_frags = 2 if kp % (2 * IMMA_TILE) == 0 else 1
    m, m1 = sch.split(m, [None, IMMA_TILE])
    q, q1 = sch.split(q, [None, IMMA_TILE])
    k, k1 = sch.split(k, [None, IMMA_TILE])
    by, wy, mi = sch.split(m, [None, IMMA_WARPS, IMMA_FRAGMENTS])
    bx, wx, qi = sch.split(q, [None, IMMA_WARPS, IMMA_FRAGMENTS])
    ko, ki = sch.split(k, [None, k_frags])
    sch.reorder(g, by, bx, wy, wx, ko, ki, mi, qi, m1, q1, k1)
    sch.bind(g, "blockIdx.z")
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(wy, "threadIdx.y")
    sch.bind(wx, "threadIdx.z")
    acc = sch.cache_write(blk, 0, "wmma.accumulator")
    sch.reverse_compute_at(acc, wx)
    tile_bytes = TILE_MQ * IMMA_TILE * k_frags
    for index in (0, 1):
        shared = sch.cache_read(blk, index, "shared")
        sch.compute_at(shared, ko)
        sch.storage_align(shared, 0, axis=-2, factor=32, offset=16)
        _fetch_shared(sch, shared, min(16, tile_bytes // (IMMA_WARPS * IMMA_WARPS * WARP)))
    a_frag = sch.cache_read(blk, 0, "wmma.matrix_a")
    b_frag = sch.cache_read(blk, 1, "wmma.matrix_b")
    sch.compute_at(a_frag, ki)
    sch.compute_at(b_frag, ki)
    init = sch.decompose_reduction(blk, ko)
    # imported here, after install(): registering TVM's CUDA tensor intrinsics took 75 s in
    # inspect.stack (mexc/lowering/tvmscript_stack.py), now about a second
    tvmscript_stack.install()
    from tvm.s_tir.tensor_intrin import cuda as cuda_intrin

    sch.tensorize(_fragments(sch, a_frag), cuda_intrin.WMMA_LOAD_16x16x16_S8_A_INTRIN)
    sch.tensorize(_fragments(sch, b_frag), cuda_intrin.WMMA_LOAD_16x16x16_S8_B_TRANS_INTRIN)
    sch.tensorize(sch.get_loops(init)[-2], cuda_intrin.WMMA_FILL_16x16x16_S32_INTRIN)
    sch.tensorize(_fragments(sch, acc), cuda_intrin.WMMA_STORE_16x16x16_S32_GLOBAL_INTRIN)
    sch.tensorize(m1, cuda_intrin.WMMA_SYNC_16x16x16_s8s8s32_TRANS_INTRIN)
    return sch.mod["main"]


GEMM_SCHEDULES = {"imma": schedule_gemm_imma, "dp4a": schedule_gemm_dp4a}


def gemm_schedule() -> str:
    """The GEMM schedule of CUDA builds: int8 tensor cores ("imma", default) or `__dp4a`
    (MEXC_CUDA_GEMM=dp4a)."""
    kind = os.environ.get("MEXC_CUDA_GEMM", "imma")
    if kind not in GEMM_SCHEDULES:
        raise ValueError(f"MEXC_CUDA_GEMM={kind!r}: choose one of {sorted(GEMM_SCHEDULES)}")
    return kind


def schedule_product(funcs: GemmFuncs) -> dict[str, tirx.PrimFunc]:
    """The scheduled PrimFuncs (symbol -> func) of one product, in launch order: the GEMM with
    `__dp4a`, the gathers one thread per element."""
    return {
        symbol: (schedule_gemm_dp4a if symbol.endswith("_gemm") else schedule_gpu)(func).with_attr(
            "global_symbol", symbol
        )
        for symbol, func in funcs.items()
    }


def cuda_source(funcs: dict[str, tirx.PrimFunc], arch: str) -> str:
    """CUDA C++ source of scheduled PrimFuncs (TVM emits source only; no GPU is needed)."""
    return lower_kernels(funcs, arch)[0]
