# mypy: disable-error-code="valid-type"
# (TVMScript buffer annotations are calls that mypy cannot read as types)
"""Int8 dot-product tensor intrinsics for x86 hosts (TVM tensorize), one per byte kernel:

    C[0:8] += sum_{k<4} A[k] * B[0:8, k]        A: 4 int8, B: 8 x 4 int8, C: 8 int32

"avx2_i8" (AVX2 hosts without VNNI):

`vpmaddubsw` multiplies unsigned by signed bytes and adds adjacent pairs into saturating int16,
so it is exact only while a pair sum stays within int16. With |A| as the unsigned side and
sign(A)·B as the signed one (`vpsignb`), a pair is at most 2·127·127 = 32,258 < 2^15: no
saturation for mantissas in [-127, 127] (-128 never occurs, docs/numerics.md section 1).
`vpmaddwd` by ones then adds the pairs into int32 lanes. One instruction pair does 32
multiply-accumulates where the int32 tile's `vpmulld` does 8: 2.3-3.9x the int32 tile's GEMM
throughput on this Zen 3 host (bench/research/gemm_kernels.py, docs/cpu.md).

"vnni_i8" (AVX-512 VNNI with VL, or AVX-VNNI): `vpdpbusd` multiplies the same |A| and sign(A)·B
and adds each group of four products straight into the int32 lanes, one instruction where the
AVX2 kernel needs two and an add. Its sums wrap rather than saturate, and a lane's four
products are at most 4·127·127 < 2^16 in magnitude: exact.
"""

from __future__ import annotations

import functools

from tvm import s_tir
from tvm.script import tirx as T

from mexc.lowering import tvmscript_stack

INTRINSICS = {"avx2_i8": "mexc_avx2_i8_dot_8x4", "vnni_i8": "mexc_vnni_i8_dot_8x4"}
BYTE_KERNELS = tuple(INTRINSICS)  # cpu_gemm's kernels that multiply bytes on column panels
COLUMNS = 8  # int32 lanes of one AVX2 register
DEPTH = 4  # bytes of A per int32 lane


# the @T.prim_func below run at import: TVMScript's stack walk made cheap first
tvmscript_stack.install()


@T.prim_func(s_tir=True)
def _desc(
    A: T.Buffer((4,), "int8", offset_factor=1),
    B: T.Buffer((8, 4), "int8", offset_factor=1),
    C: T.Buffer((8,), "int32", offset_factor=1, scope="local"),
) -> None:
    with T.sblock("root"):
        T.reads(C[0:8], A[0:4], B[0:8, 0:4])
        T.writes(C[0:8])
        for i in T.serial(0, 8):
            for k in T.serial(0, 4):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")


def _signed_operands(A, B):  # noqa: N803 - the intrinsics' buffer names
    """|A| (broadcast to every lane) and sign(A)·B, as `vpsignb` makes them: the unsigned and
    the signed side of both kernels' byte products."""
    a_word = T.reinterpret(A.vload([0], "int8x4"), dtype="int32")
    a = T.reinterpret(T.broadcast(a_word, 8), dtype="int8x32")
    b = B.vload([0, 0], dtype="int8x32")
    a_abs = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", a, a)
    return a_abs, T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", b, a)


@T.prim_func(s_tir=True)
def _impl_avx2(
    A: T.Buffer((4,), "int8", offset_factor=1),
    B: T.Buffer((8, 4), "int8", offset_factor=1),
    C: T.Buffer((8,), "int32", offset_factor=1, scope="local"),
) -> None:
    with T.sblock("root"):
        T.reads(C[0:8], A[0:4], B[0:8, 0:4])
        T.writes(C[0:8])
        a_abs, b_signed = T.meta_var(_signed_operands(A, B))
        pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", a_abs, b_signed)
        quads = T.call_llvm_pure_intrin(
            "int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.broadcast(T.int16(1), 16)
        )
        C[T.ramp(T.int32(0), 1, 8)] = C.vload([0], dtype="int32x8") + quads


@T.prim_func(s_tir=True)
def _impl_vnni(
    A: T.Buffer((4,), "int8", offset_factor=1),
    B: T.Buffer((8, 4), "int8", offset_factor=1),
    C: T.Buffer((8,), "int32", offset_factor=1, scope="local"),
) -> None:
    with T.sblock("root"):
        T.reads(C[0:8], A[0:4], B[0:8, 0:4])
        T.writes(C[0:8])
        a_abs, b_signed = T.meta_var(_signed_operands(A, B))
        # LLVM 22 declares the byte operands as <32 x i8> (../shared/probes/tvm-0.27)
        C[T.ramp(T.int32(0), 1, 8)] = T.call_llvm_pure_intrin(
            "int32x8",
            "llvm.x86.avx512.vpdpbusd.256",
            C.vload([0], dtype="int32x8"),
            a_abs,
            b_signed,
        )


@functools.cache
def registered(kernel: str = "avx2_i8") -> str:
    """The name of `kernel`'s intrinsic, registered with TVM once per process."""
    impl = {"avx2_i8": _impl_avx2, "vnni_i8": _impl_vnni}[kernel]
    s_tir.TensorIntrin.register(INTRINSICS[kernel], _desc, impl, override=True)
    return INTRINSICS[kernel]
