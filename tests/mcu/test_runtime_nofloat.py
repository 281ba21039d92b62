"""The runtime has no floating point: no float/double in the sources, and the Cortex-M builds
(soft-float ABI, M0/M3/M4) reference no soft-float helper and contain no FPU instruction."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.mcu.test_runtime_lib import RUNTIME, lib_sources

SOURCES = sorted(p for p in RUNTIME.rglob("*") if p.suffix in (".c", ".h"))
SOFT_FLOAT = re.compile(r"^(__aeabi_[fd]\w*|__\w*sf\w*|__\w*df\w*|__float\w*|__fix\w*)$")
FPU_INSN = re.compile(r"\s(v(add|sub|mul|div|mov|ldr|str|cvt|cmp|sqrt|abs|neg|push|pop)\S*)\s")


def test_no_float_in_sources():
    assert SOURCES, "runtime/ has no sources"
    for path in SOURCES:
        text = path.read_text()
        hits = re.findall(r"\b(float|double|long\s+double|_Complex)\b", text)
        assert not hits, f"{path.name}: {hits}"
        assert not re.search(r"\bmalloc\s*\(|<math\.h>", text), path.name


@pytest.mark.mcu
@pytest.mark.parametrize("cpu", ["cortex-m0", "cortex-m3", "cortex-m4"])
def test_mcu_build_has_no_soft_float(cpu, tmp_path: Path):
    gcc, nm, objdump = (shutil.which(f"arm-none-eabi-{t}") for t in ("gcc", "nm", "objdump"))
    if gcc is None or nm is None or objdump is None:
        pytest.skip("arm-none-eabi-gcc / nm / objdump not installed")
    objs = []
    for src in lib_sources():
        obj = tmp_path / (src.stem + ".o")
        subprocess.run(
            [
                gcc,
                f"-mcpu={cpu}",
                "-mthumb",
                "-mfloat-abi=soft",
                "-O2",
                "-std=c99",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-ffreestanding",
                "-fstack-usage",
                "-c",
                str(src),
                "-o",
                str(obj),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        objs.append(str(obj))
    syms = subprocess.run([nm, "-u", *objs], check=True, capture_output=True, text=True).stdout
    undefined = {line.split()[-1] for line in syms.splitlines() if line.strip().startswith("U")}
    bad = sorted(s for s in undefined if SOFT_FLOAT.match(s))
    assert not bad, f"soft-float helpers referenced: {bad}"
    # only integer helpers of libgcc and our own symbols
    allowed = re.compile(
        r"^(mexc_\w+|__aeabi_(uidiv|uidivmod|idiv|idivmod|uldivmod|ldivmod|"
        r"lmul|llsl|llsr|lasr))$"
    )
    assert all(allowed.match(s) for s in undefined), sorted(undefined)
    dis = subprocess.run([objdump, "-d", *objs], check=True, capture_output=True, text=True).stdout
    assert not FPU_INSN.search(dis), FPU_INSN.search(dis)
    # every frame has a static size (no VLA / alloca), so the stack bound is computable
    for su in tmp_path.glob("*.su"):
        for line in su.read_text().splitlines():
            assert line.rstrip().endswith("static"), line
