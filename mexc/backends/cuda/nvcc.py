"""Offline CUDA toolchain: nvcc to cubin, cuobjdump/nvdisasm to SASS (no GPU needed).

nvcc comes from the machine (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin); cuobjdump and
nvdisasm from the PyPI wheels `nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` when they are not
on PATH (they install their binaries under site-packages/nvidia/cu*/bin).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from mexc.backends.cuda.runtime import ARCHS
from mexc.errors import MexcError

# warnings of TVM's generated source that say nothing about correctness: unused CSE temporaries,
# and TVM's own __dp4a helper beside the CUDA builtin
_QUIET = ("-diag-suppress", "177,20044")


class ToolchainError(MexcError):
    """A CUDA tool is missing or failed."""


def _wheel_bin_dirs() -> list[Path]:
    out = []
    for base in sys.path:
        nvidia = Path(base) / "nvidia"
        if nvidia.is_dir():
            out += sorted(p for p in nvidia.glob("cu*/bin") if p.is_dir())
    return out


def find_tool(name: str) -> Path:
    """Path of a CUDA tool, or a ToolchainError saying how to get it."""
    found = shutil.which(name)
    if found:
        return Path(found)
    dirs = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin", *_wheel_bin_dirs()]
    for d in dirs:
        if (d / name).is_file():
            return d / name
    hint = (
        "install the CUDA toolkit (nvcc 12.x or 13.x) or put it on PATH"
        if name == "nvcc"
        else f"pip install nvidia-cuda-{name} (or put the CUDA toolkit's bin on PATH)"
    )
    raise ToolchainError(f"{name} was not found: {hint}.")


def compile_cubin(source: Path, arch: str, out: Path) -> Path:
    """nvcc -cubin -O3 for one architecture (sm_80 / sm_90)."""
    if arch not in ARCHS:
        raise ToolchainError(f"arch must be one of {ARCHS}, got {arch!r}")
    cmd = [str(find_tool("nvcc")), f"-arch={arch}", "-cubin", "-O3", *_QUIET, "-o", str(out)]
    run = subprocess.run([*cmd, str(source)], capture_output=True, text=True, check=False)
    if run.returncode:
        raise ToolchainError(f"nvcc failed for {source} ({arch}):\n{run.stderr[-4000:]}")
    return out


def sass_opcodes(cubin: Path) -> dict[str, Counter[str]]:
    """{kernel symbol: Counter of SASS opcodes with their modifiers} of a cubin."""
    tool = find_tool("cuobjdump")
    env = dict(os.environ)
    env["PATH"] = f"{find_tool('nvdisasm').parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        [str(tool), "-sass", str(cubin)], capture_output=True, text=True, env=env, check=False
    )
    if run.returncode:
        raise ToolchainError(f"cuobjdump failed on {cubin}:\n{run.stderr[-2000:]}")
    kernels: dict[str, Counter[str]] = {}
    current: Counter[str] | None = None
    for line in run.stdout.splitlines():
        head = re.match(r"\s*Function : (\S+)", line)
        if head:
            current = kernels.setdefault(head.group(1), Counter())
            continue
        op = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if op and current is not None:
            current[_normalize(op.group(1), op.group(2))] += 1
    return kernels


# a three-input min/max whose first two sources are one register: what nvcc 13.0's ptxas made
# of max(m, max(v, -v)) for sm_90, the negation lost (te_compaction.iabs; sass_check refuses it)
SAME_SOURCES = ".SAME_SOURCES"


def _normalize(opcode: str, operands: str) -> str:
    """ptxas materializes constants with `HFMA2.MMA Rd, -RZ, RZ, a, b` (= a register move on the
    FMA pipe, computing 0 * 0 + constant): count it as a move, not as half-precision math. A
    VIMNMX3 with two equal sources is marked SAME_SOURCES."""
    if opcode == "HFMA2.MMA" and re.match(r"\s*R\d+, -RZ, RZ,", operands):
        return "MOV.HFMA2"
    if opcode.startswith("VIMNMX3"):
        srcs = [o.strip() for o in operands.split(";")[0].split(",")[1:3]]
        if len(srcs) == 2 and srcs[0] == srcs[1] and srcs[0] != "RZ":
            return opcode + SAME_SOURCES
    return opcode


def integer_mma(opcodes: Counter[str]) -> int:
    """Number of int8 dot-product / tensor-core instructions (IDP.4A, IMMA) among `opcodes`."""
    return sum(n for op, n in opcodes.items() if op.startswith(("IDP.4A", "IMMA")))


# SASS opcodes (without modifiers) that compute in or convert to/from floating point
FLOAT_SASS = frozenset(
    [
        "FADD",
        "FADD32I",
        "FMUL",
        "FMUL32I",
        "FFMA",
        "FFMA32I",
        "FSETP",
        "FSET",
        "FMNMX",
        "FCHK",
        "FRND",
        "FSWZADD",
        "F2I",
        "F2F",
        "F2FP",
        "I2F",
        "I2FP",
        "DADD",
        "DMUL",
        "DFMA",
        "DSETP",
        "DMNMX",
        "HADD2",
        "HMUL2",
        "HFMA2",
        "HSETP2",
        "HMNMX2",
        "MUFU",
    ]
)


def float_opcodes(opcodes: Counter[str]) -> list[str]:
    """The floating-point instructions among `opcodes` (empty for an integer-only kernel)."""
    return sorted(op for op in opcodes if op.split(".")[0] in FLOAT_SASS)
