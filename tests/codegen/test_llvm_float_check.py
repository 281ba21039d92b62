"""target="llvm": the compiled training step holds no floating-point instruction
(mexc/backends/llvm/float_check.py), and the scanner does flag float code when there is some."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import mexc
from mexc.backends.llvm import float_check as fc
from tests.compiler.helpers import EXAMPLES

needs_objdump = pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
needs_gcc = pytest.mark.skipif(
    shutil.which("gcc") is None or platform.machine() != "x86_64", reason="no x86-64 gcc"
)

# objdump -d -M intel output, cut to the parts the scanner reads
SAMPLE = """
k.so:     file format elf64-x86-64

Disassembly of section .text:

0000000000001000 <__tvm_ffi_k>:
    1000:\tvmovaps ymm1,YMMWORD PTR [rdi]
    1004:\tvxorps xmm0,xmm0,xmm0
    1008:\tcall   1100 <k_compute_>
    100d:\tcall   1030 <memset@plt>
    1012:\tret

0000000000001100 <k_compute_>:
    1100:\tvpaddd ymm0,ymm1,ymm2
    1104:\tvpmaddubsw ymm0,ymm1,ymm2
    1108:\t{evex} vpdpbusd zmm0,zmm1,zmm2
    110e:\tvmovdqu YMMWORD PTR [rsi],ymm0
    1112:\tvpxor  xmm3,xmm3,xmm3
    1116:\tvblendps ymm0,ymm0,ymm1,0xf0
    111a:\tvbroadcastss ymm0,DWORD PTR [rdx]
    111e:\trep movsd DWORD PTR es:[rdi],DWORD PTR ds:[rsi]
    1120:\tcmpsd  DWORD PTR ds:[rsi],DWORD PTR es:[rdi]
    1122:\tmovss  xmm0,DWORD PTR [rdx]
    1126:\taddss  xmm0,xmm1
    112a:\tcvtsi2ss xmm0,eax
    112e:\tvfmadd231ps ymm0,ymm1,ymm2
    1133:\tfld    DWORD PTR [rsp]
    1136:\tvcmpltps ymm0,ymm1,ymm2
    113b:\tucomisd xmm0,xmm1
    113f:\tcmpsd  xmm0,xmm1,0x1
    1144:\tvmaxps zmm0,zmm1,zmm2
    114a:\tcall   1200 <__extendhfsf2>
    114f:\tjmp    1040 <expf@plt>

0000000000001200 <__extendhfsf2>:
    1200:\tvcvtph2ps xmm0,xmm0
    1205:\tret
"""
FLAGGED = {
    0x1126: "addss",
    0x112A: "cvtsi2ss",
    0x112E: "vfmadd231ps",
    0x1133: "fld",
    0x1136: "vcmpltps",
    0x113B: "ucomisd",
    0x113F: "cmpsd",
    0x1144: "vmaxps",
    0x114A: "call",  # into a float builtin
    0x114F: "jmp",  # into libm
}


@pytest.mark.parametrize(
    "mnemonic,operands,is_float",
    [
        ("addss", "xmm0,xmm1", True),
        ("mulsd", "xmm0,xmm1", True),
        ("vdivpd", "", True),
        ("vsqrtps", "", True),
        ("vfnmsub132sd", "", True),
        ("vcvttss2si", "eax,xmm0", True),
        ("vcvtdq2ps", "", True),
        ("cvtsi2ssl", "%eax,%xmm0", True),  # AT&T spelling
        ("vcmpps", "k1,zmm0,zmm1,0x1", True),
        ("vcomiss", "", True),
        ("vrndscaleps", "", True),
        ("vdpbf16ps", "", True),
        ("vaddph", "", True),
        ("fistp", "", True),
        ("fadd", "", True),
        ("ldmxcsr", "", True),
        ("pfadd", "", True),
        ("vmovaps", "", False),
        ("vmovups", "", False),
        ("vxorps", "", False),
        ("vandnpd", "", False),
        ("vblendvps", "", False),
        ("vshufps", "", False),
        ("vpermilps", "", False),
        ("vunpcklpd", "", False),
        ("vinsertps", "", False),
        ("vextractps", "", False),
        ("vgatherdps", "", False),
        ("vmovmskps", "", False),
        ("vtestps", "", False),
        ("vpaddd", "", False),
        ("vpmaddubsw", "", False),
        ("vpdpbusd", "", False),
        ("vpmaxsd", "", False),
        ("vpmulld", "", False),
        ("vpabsd", "", False),
        ("kmovd", "", False),
        ("push", "rbp", False),
        ("cmpsd", "DWORD PTR ds:[rsi],DWORD PTR es:[rdi]", False),
        ("imul", "eax,ecx", False),
        ("clflush", "BYTE PTR [rax]", False),
        ("sbb", "", False),
    ],
)
def test_rule(mnemonic: str, operands: str, is_float: bool) -> None:
    assert fc.is_float_instruction(mnemonic, operands) is is_float


def test_sample_flags_exactly_the_float_instructions() -> None:
    scan = fc.scan_disassembly(SAMPLE, "k.so", ["k"])
    assert {f.address: f.mnemonic for f in scan.floats} == FLAGGED
    assert all(f.function == "k_compute_" for f in scan.floats)
    assert scan.excluded == ["__extendhfsf2"]  # not scanned, but calling it is flagged
    assert scan.unexpected == []
    assert scan.instructions == {"__tvm_ffi_k": 5, "k_compute_": 20}


def test_the_entry_alias_of_a_one_kernel_library_is_glue() -> None:
    """A kernel-store part that compiled one kernel: TVM adds __tvm_ffi_main, a jmp to it."""
    alias = "\n0000000000001300 <__tvm_ffi_main>:\n    1300:\tjmp    1050 <__tvm_ffi_k@plt>\n"
    scan = fc.scan_disassembly(SAMPLE + alias, "k.so", ["k"])
    assert scan.unexpected == [] and scan.instructions["__tvm_ffi_main"] == 1
    float_alias = alias + "    1305:\taddss  xmm0,xmm1\n"  # still scanned for floats
    scan = fc.scan_disassembly(SAMPLE + float_alias, "k.so", ["k"])
    assert [f.function for f in scan.floats if f.address == 0x1305] == ["__tvm_ffi_main"]


def test_unknown_function_and_missing_kernel_are_reported() -> None:
    scan = fc.scan_disassembly(SAMPLE, "k.so", ["other"])
    assert scan.unexpected == ["__tvm_ffi_k", "k_compute_"]


def test_other_architecture_is_unsupported(tmp_path: Path) -> None:
    arm = SAMPLE.replace("elf64-x86-64", "elf64-littleaarch64")
    with pytest.raises(fc.UnsupportedArchitecture, match="unsupported architecture aarch64"):
        fc.scan_disassembly(arm)
    so = tmp_path / "arm.so"  # an ELF header with e_machine = EM_AARCH64
    so.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(11) + (183).to_bytes(2, "little") + bytes(44))
    assert fc.elf_architecture(so) == "aarch64"
    with pytest.raises(fc.UnsupportedArchitecture, match="unsupported architecture aarch64"):
        fc.check_libraries([so], ["k"])


KERNEL_C = """
static __attribute__((noinline)) int k_compute_(const signed char *a, int *out, int n) {
  int s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * a[i];
  out[0] = s;
  return 0;
}
int __tvm_ffi_k(const signed char *a, int *out, int n) { return k_compute_(a, out, n); }
"""
FLOAT_KERNEL_C = """
static __attribute__((noinline)) int k_compute_(const float *a, int *out, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * 0.5f;
  out[0] = (int)s;
  return 0;
}
int __tvm_ffi_k(const float *a, int *out, int n) { return k_compute_(a, out, n); }
"""


def _shared_library(tmp_path: Path, source: str, *libs: str) -> Path:
    src, so = tmp_path / "k.c", tmp_path / "k.so"
    src.write_text(source)
    cmd = ["gcc", "-O2", "-mavx2", "-mfma", "-shared", "-fPIC", str(src), "-o", str(so), *libs]
    subprocess.run(cmd, check=True, capture_output=True)
    return so


def _fake_program(so: Path) -> Any:
    plan = {"launches": [["n0_k", ["a", "out"]]], "kernels": {"n0_k": [so.name, "k"]}}
    return SimpleNamespace(libraries=[so], _plan_json=plan)


@needs_gcc
@needs_objdump
def test_compiled_float_kernel_is_flagged(tmp_path: Path) -> None:
    prog = _fake_program(_shared_library(tmp_path, FLOAT_KERNEL_C))
    found = fc.float_instructions(prog)
    assert found and {f.function for f in found} == {"k_compute_"}
    assert any(f.mnemonic.startswith(("vcvt", "cvt")) for f in found)
    assert any(f.mnemonic.startswith(("vmul", "vadd", "vfmadd", "mul", "add")) for f in found)
    with pytest.raises(
        fc.FloatCheckError, match=r"k\.so: k_compute_ @0x[0-9a-f]+: v?(cvt|mul|add)"
    ):
        fc.check_integer_only(prog)


LIBM_KERNEL_C = """
#include <math.h>
static __attribute__((noinline)) int k_compute_(const int *a, int *out) {
  out[0] = (int)expf((float)a[0]);
  return 0;
}
int __tvm_ffi_k(const int *a, int *out) { return k_compute_(a, out); }
"""


@needs_gcc
@needs_objdump
def test_libm_import_is_flagged(tmp_path: Path) -> None:
    report = fc.float_check(_fake_program(_shared_library(tmp_path, LIBM_KERNEL_C, "-lm")))
    assert report.foreign == ["k.so: expf"]
    assert any("expf@plt" in f.text for f in report.floats)  # the call into the PLT
    assert any(f.mnemonic.startswith(("cvt", "vcvt")) for f in report.floats)


@needs_gcc
@needs_objdump
def test_compiled_integer_kernel_passes(tmp_path: Path) -> None:
    report = fc.check_integer_only(_fake_program(_shared_library(tmp_path, KERNEL_C)))
    assert report.ok and report.kernels["k"] > 5


def _optimizer() -> mexc.SGD:
    return mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, 2))


@needs_objdump
@pytest.mark.skipif(platform.machine() != "x86_64", reason="float rules are for x86-64")
@pytest.mark.parametrize("name,batch", [("DigitsCNN", 8), ("MobileNetV2Tiny", 2)])
def test_example_steps_are_integer_only(name: str, batch: int) -> None:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(batch, *shape),), optimizer=_optimizer(), target="llvm")
    report = fc.check_integer_only(prog)  # raises, naming each float instruction, if any
    assert report.floats == [] and report.missing == []
    symbols = fc.launch_symbols(prog._plan_json)
    assert set(report.kernels) == set(symbols)
    assert all(n > 0 for n in report.kernels.values())  # every kernel's code was scanned
    assert sum(report.kernels.values()) > 1000


@needs_objdump
@pytest.mark.skipif(platform.machine() != "x86_64", reason="float rules are for x86-64")
@pytest.mark.xfail(
    strict=True,
    raises=fc.FloatCheckError,
    reason="issue #22: built for an x86 host without AVX2 (SSE 4.2, no vpsllvd), LLVM lowers the "
    "per-lane variable left shift of the batch-norm running-mean compaction (n*_mean_c_apply) "
    "to pslld 23 / paddd 1.0f / cvttps2dq (2^s built as a float, exact but float)",
)
def test_sse_host_step_is_integer_only() -> None:
    from mexc.backends.llvm.products import HostCpu
    from mexc.backends.llvm.step import LlvmProgram

    cls, shape = EXAMPLES["DigitsCNN"]
    torch.manual_seed(0)
    ref = mexc.compile(cls(), (torch.zeros(8, *shape),), optimizer=_optimizer())
    sse = HostCpu("x86_64", frozenset({"sse4_2"}))
    fc.check_integer_only(LlvmProgram(ref.retargeted("llvm"), cpu=sse))
