"""The integer-only and completeness proof of a CUDA artifact (no GPU needed): what tests and CI
run on every build (`python bench/cuda_build.py --check`).

- no floating-point type or literal in any kernel's source (TVM's preamble, which precedes the
  first kernel, is library code) and no floating-point instruction in any kernel's SASS;
- every kernel the plan launches is in the cubin of every architecture;
- every GEMM kernel runs on integer MMA units (IMMA with the tensor-core schedule, IDP.4A with
  dp4a) and nothing else of the kind;
- every kernel argument is a plan buffer or view, every launch shape is valid;
- no three-input min/max with two equal sources: ptxas's miscompile of max(m, max(v, -v)) for
  sm_90 (nvcc 13.0; te_compaction.iabs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mexc.backends.cuda.nvcc import SAME_SOURCES, float_opcodes, integer_mma, sass_opcodes

FLOAT_SOURCE = re.compile(
    r"\b(float|double|half|__half2?|__nv_bfloat16)\b"
    r"|\b\d+\.\d*(e[+-]?\d+)?f?\b|0x[0-9a-f.]+p[+-]?\d+"
)
# fewest integer MMA instructions in a GEMM kernel: 2x2 WMMA fragments per warp and one or two
# per K step (2 IMMA.16816 each); dp4a: a 4x4 register tile per 4 K-values
MIN_MMA = {"imma": 8, "dp4a": 16}
MMA_OPCODE = {"imma": "IMMA", "dp4a": "IDP.4A"}


def artifact_opcodes(out: Path, manifest: dict[str, Any]) -> list[dict[str, dict[str, Any]]]:
    """Per module, per architecture: {kernel: Counter of SASS opcodes} (nvdisasm, the slow part
    of a check: read once)."""
    return [
        {arch: sass_opcodes(out / cubin["file"]) for arch, cubin in entry["cubins"].items()}
        for entry in manifest["modules"]
    ]


def verify_artifact(
    out: Path, manifest: dict[str, Any], opcodes: list[dict[str, dict[str, Any]]] | None = None
) -> list[str]:
    """Every way the artifact in `out` breaks the rules above (empty when it keeps them),
    its inference artifact's (the subfolder manifest["inference"] names) included;
    `opcodes`: artifact_opcodes(out, manifest) when the caller has read them already."""
    opcodes = opcodes if opcodes is not None else artifact_opcodes(out, manifest)
    problems: list[str] = []
    buffers = set(manifest["buffers"]) | set(manifest["views"])
    gemm = manifest["gemm"]
    for module, entry in enumerate(manifest["modules"]):
        source = (out / entry["source"]).read_text()
        found = FLOAT_SOURCE.search(source[source.index('extern "C"') :])
        if found:
            problems.append(f"{entry['source']}: float in the kernel source: {found.group(0)!r}")
        planned = {k[1] for k in manifest["kernels"] if k[0] == module}
        gemms = set(manifest["gemm_kernels"]) & planned
        for arch, ops in opcodes[module].items():
            problems += _check_sass(ops, planned, gemms, gemm, arch)
    for _, symbol, grid, block, args in manifest["kernels"]:
        if any(a not in buffers for a in args):
            problems.append(f"{symbol}: an argument is not a plan buffer")
        threads = block[0] * block[1] * block[2]
        if not 1 <= threads <= 1024 or min(grid) < 1:
            problems.append(f"{symbol}: launch grid {grid} block {block}")
    if not manifest["gemm_kernels"]:
        problems.append("no GEMM kernel")
    if manifest.get("inference"):
        folder = out / manifest["inference"]
        inner = json.loads((folder / "plan.json").read_text())
        problems += [f"{manifest['inference']}/: {p}" for p in verify_artifact(folder, inner)]
    return problems


def _check_sass(opcodes: dict, planned: set[str], gemms: set[str], gemm: str, arch: str) -> list:
    problems = [
        f"{arch}: kernel {k} missing from the cubin" for k in sorted(planned - set(opcodes))
    ]
    problems += [f"{arch}: {k} has float instructions {float_opcodes(v)}" for k, v in
                 opcodes.items() if float_opcodes(v)]  # fmt: skip
    problems += [
        f"{arch}: {k} has {op}: ptxas dropped a negation (max of v and -v; te_compaction.iabs)"
        for k, v in opcodes.items()
        for op in v
        if op.endswith(SAME_SOURCES)
    ]
    for symbol in sorted(gemms & set(opcodes)):
        ops = opcodes[symbol]
        mma = sum(n for op, n in ops.items() if op.startswith(MMA_OPCODE[gemm]))
        if mma < MIN_MMA[gemm] or integer_mma(ops) != mma:
            problems.append(f"{arch}: GEMM {symbol} has {mma} {MMA_OPCODE[gemm]} instructions")
    return problems
