"""Product kernels lowered with TVM and printed as plain C: exact against numpy on the host, and
free of floating point and of the TVM runtime when built for a Cortex-M without FPU."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from product_refs import CONV_CASES, Conv, all_cases, rand_int8, reference

from mexc.backends.c import plain_c
from mexc.backends.c.plain_c import PlainCError, emit_plain_c
from mexc.lowering import te_products

CASES = all_cases()
HOST_CFLAGS = ["-O2", "-shared", "-fPIC", "-std=c99", "-Wall", "-Wextra", "-Werror"]
ARM_CPUS = ["cortex-m0", "cortex-m3", "cortex-m4"]
# Soft-float helpers of libgcc / the ARM run-time ABI.
SOFT_FLOAT = re.compile(r"^__(aeabi_[fd]|float|fix|\w*[sd]f)")
# Integer division helpers allowed on cores without a divide instruction (cortex-m0).
INT_DIV = {"__aeabi_idiv", "__aeabi_uidiv", "__aeabi_idivmod", "__aeabi_uidivmod"}


def _symbol(prod: str, cid: str) -> str:
    return f"{prod}__{cid}"


def _case_id(case: tuple[str, str, tuple]) -> str:
    return f"{case[0]}-{case[1]}"


@pytest.fixture(scope="module")
def funcs() -> dict:
    builders = {**te_products.CONV_PRODUCTS, **te_products.LINEAR_PRODUCTS}
    return {
        _symbol(prod, cid): te_products.schedule_mcu(builders[prod](*args, name=_symbol(prod, cid)))
        for prod, cid, args in CASES
    }


@pytest.fixture(scope="module")
def source(funcs: dict) -> str:
    return emit_plain_c(funcs)


@pytest.fixture(scope="module")
def host_lib(source: str, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    d = tmp_path_factory.mktemp("plain_c")
    (d / "products.c").write_text(source)
    so = d / "products.so"
    subprocess.run(["cc", *HOST_CFLAGS, "products.c", "-o", so.name], cwd=d, check=True)
    return ctypes.CDLL(str(so))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_host_exact(case: tuple, funcs: dict, host_lib: ctypes.CDLL) -> None:
    prod, cid, args = case
    sym = _symbol(prod, cid)
    a_p, b_p, out_p = te_products.params(funcs[sym])
    assert (a_p.dtype, b_p.dtype, out_p.dtype) == ("int8", "int8", "int32")
    rng = np.random.default_rng(zlib.crc32(sym.encode()))
    a, b = rand_int8(rng, a_p.shape), rand_int8(rng, b_p.shape)
    a_copy, b_copy = a.copy(), b.copy()
    out = np.full(out_p.shape, 0x5A5A5A5A, np.int32)  # catches unwritten elements
    fn = getattr(host_lib, sym)
    fn.restype = None
    fn(*(arr.ctypes.data_as(ctypes.c_void_p) for arr in (a, b, out)))
    want = reference(prod, args, a, b)
    assert want.shape == out.shape
    np.testing.assert_array_equal(out.astype(np.int64), want)
    assert np.array_equal(a, a_copy) and np.array_equal(b, b_copy)


@pytest.mark.parametrize("cid", list(CONV_CASES))
def test_references_match_torch(cid: str) -> None:
    """The numpy references are the convolution and its two gradients (float64 is exact here)."""
    case = CONV_CASES[cid]
    conv = Conv.of(case)
    rng = np.random.default_rng(7)
    x = rand_int8(rng, (conv.n, conv.c, conv.h, conv.w))
    w = rand_int8(rng, (conv.o, conv.c // conv.groups, conv.kh, conv.kw))
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.conv2d(xt, wt, None, conv.stride, conv.padding, 1, conv.groups)
    dy = rand_int8(rng, tuple(y.shape))
    y.backward(torch.tensor(dy, dtype=torch.float64))
    assert xt.grad is not None and wt.grad is not None
    np.testing.assert_array_equal(y.detach().numpy(), conv.forward(x, w))
    np.testing.assert_array_equal(xt.grad.numpy(), conv.grad_input(dy, w))
    np.testing.assert_array_equal(wt.grad.numpy(), conv.grad_weight(dy, x))


def test_pointer_abi(source: str) -> None:
    assert "void linear_acc__small(const int8_t* x, const int8_t* w, int32_t* acc)" in source
    assert "void conv2d_grad_input_acc__1x1(const int8_t* dy, const int8_t* w, int32_t* dx)" in (
        source
    )
    assert "void conv2d_grad_weight_acc__1x1(const int8_t* dy, const int8_t* x, int32_t* dw)" in (
        source
    )


def test_no_float_no_tvm(source: str) -> None:
    assert not re.search(r"\b(float|double)\b", source)
    assert "tvm" not in source.lower() and "DL" not in source
    includes = re.findall(r"#include\s*(\S+)", source)
    assert set(includes) <= {"<stdint.h>", "<stdbool.h>"}


def _arm_nm(source: str, cpu: str, d: Path) -> str:
    """Compile `source` for a soft-float Cortex-M and return `nm` of the object."""
    gcc, nm = shutil.which("arm-none-eabi-gcc"), shutil.which("arm-none-eabi-nm")
    if gcc is None or nm is None:
        pytest.skip("arm-none-eabi-gcc not installed")
    (d / "products.c").write_text(source)
    flags = [f"-mcpu={cpu}", "-mthumb", "-mfloat-abi=soft", "-O2", "-std=c99", "-ffreestanding"]
    flags += ["-Wall", "-Wextra", "-Werror", "-c"]
    subprocess.run([gcc, *flags, "products.c", "-o", "products.o"], cwd=d, check=True)
    return subprocess.run(
        [nm, "products.o"], cwd=d, check=True, capture_output=True, text=True
    ).stdout


def _undefined(nm_out: str) -> set[str]:
    return {ln.split()[-1] for ln in nm_out.splitlines() if ln.split()[:1] == ["U"]}


@pytest.mark.mcu
def test_soft_float_check_sees_float(tmp_path: Path) -> None:
    """Positive control: float code does pull in helpers the check recognises."""
    src = "float mul(float a, double b);\nfloat mul(float a, double b) { return a * (float)b; }\n"
    found = [s for s in _undefined(_arm_nm(src, "cortex-m3", tmp_path)) if SOFT_FLOAT.search(s)]
    assert found


@pytest.mark.mcu
@pytest.mark.parametrize("cpu", ARM_CPUS)
def test_cortex_m_soft_float(cpu: str, source: str, tmp_path: Path) -> None:
    out = _arm_nm(source, cpu, tmp_path)
    undefined = _undefined(out)
    assert not [s for s in undefined if SOFT_FLOAT.search(s)], undefined
    assert undefined <= INT_DIV, undefined
    defined = {ln.split()[-1] for ln in out.splitlines() if " T " in ln}
    assert {_symbol(p, c) for p, c, _ in CASES} <= defined


def test_rejects_tvm_runtime() -> None:
    src = "void f(int32_t* a) { void* p = TVMBackendAllocWorkspace(1, 0, 64, 0, 32); }\n"
    with pytest.raises(PlainCError, match="TVM runtime"):
        plain_c._check(src, 256)


def test_rejects_float() -> None:
    with pytest.raises(PlainCError, match="floating point"):
        plain_c._check("void f(float* a) {}\n", 256)


def test_rejects_big_stack_array() -> None:
    src = "void f(int32_t* a) {\n  int32_t tmp[4096];\n  a[0] = tmp[0];\n}\n"
    with pytest.raises(PlainCError, match="tmp"):
        plain_c._check(src, 256)
    plain_c._check(src, 1 << 20)


def test_bad_symbol_name(funcs: dict) -> None:
    with pytest.raises(ValueError, match="identifier"):
        emit_plain_c({"not-a-name": next(iter(funcs.values()))})


@pytest.mark.parametrize(
    "args",
    [
        (1, 3, 4, 4, 4, 3, 3, 1, 1, 2),
        (1, 2, 2, 2, 2, 3, 3, 1, 0, 1),
        (1, 2, 4, 4, 2, 3, 3, 0, 0, 1),
    ],
)
def test_bad_geometry(args: tuple) -> None:
    with pytest.raises(ValueError):
        te_products.conv2d_acc(*args)
