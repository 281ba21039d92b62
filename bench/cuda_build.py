"""Offline CUDA build of whole training steps: time, kernel counts and SASS check per model.

    python bench/cuda_build.py                         # every example model, ResNet-18, ViT-tiny
    python bench/cuda_build.py --models ResNet18 --archs sm_90

For each model (batch 128) it builds the CUDA artifact of the whole training step for the
architectures (one TVM lowering, nvcc per architecture) and reads the SASS back: the table shows
the kernel launches per step, the distinct kernels, TVM and nvcc seconds, the fewest IDP.4A / IMMA
instructions in any GEMM kernel, floating-point instructions in any kernel (must be 0), and the
GMACs of the step's products (the ViT's whole step too: every op of it is lowered). Writes
bench/results/cuda_build.json.
Needs nvcc and `pip install -e .[cuda-tools]`; no GPU. With --check it exits 1 when a build
breaks the rules of mexc.backends.cuda.sass_check (CI runs it for the models the test suite leaves
out: SmallResNet, MobileNetV2Tiny, ResNet-18).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.resnet import ResNet18  # noqa: E402
from examples.vit import ViTTiny  # noqa: E402
from mexc.backends.cuda.build import build_step  # noqa: E402
from mexc.backends.cuda.nvcc import ARCHS, float_opcodes, integer_mma  # noqa: E402
from mexc.backends.cuda.products_build import product_forms  # noqa: E402
from mexc.backends.cuda.sass_check import artifact_opcodes, verify_artifact  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {
    **EXAMPLES,
    "ViTTiny": (ViTTiny, (1, 28, 28)),
    "ResNet18": (ResNet18, (3, 32, 32)),
}


def measure(name: str, archs: tuple[str, ...], batch: int) -> dict[str, Any]:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    prog = mexc.compile(cls(), (torch.zeros(batch, *shape),))
    compile_s = time.perf_counter() - t0
    gmacs = round(sum(u.form.macs for u in product_forms(prog)) / 1e9, 3)
    ops: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        man = build_step(prog, archs, tmp)
        modules = artifact_opcodes(Path(tmp), man)
        problems = verify_artifact(Path(tmp), man, modules)
        for by_arch in modules:
            for arch, found in by_arch.items():
                ops.update({f"{arch}:{k}": v for k, v in found.items()})
        secs, launches, kind = man["seconds"], len(man["kernels"]), "step"
        counts = man["counts"]
        gemms = [f"{a}:{k}" for a in archs for k in man["gemm_kernels"]]
    return {
        "model": name,
        "build": kind,
        "archs": ",".join(archs),
        "batch": batch,
        "plan_launches": counts["plan_launches"],
        "distinct_funcs": counts["distinct_funcs"],
        "kernel_launches": launches,
        "kernels": len(ops),
        "mexc_compile_s": round(compile_s, 2),
        "tvm_s": round(secs["tvm"], 2),
        "nvcc_s": round(secs["nvcc"], 2),
        "min_int_mma_per_gemm": min(integer_mma(ops[k]) for k in gemms),
        "float_instructions": sum(len(float_opcodes(v)) for v in ops.values()),
        "gmacs_per_step": gmacs,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if any build breaks cuda_verify's rules"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda_build.json"))
    args = ap.parse_args(argv)
    archs = tuple(a.strip() for a in args.archs.split(","))
    rows = [measure(m.strip(), archs, args.batch) for m in args.models.split(",")]
    cols = [c for c in rows[0] if c != "problems"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-cuda-build-2", ["python", *sys.argv]),
            "rows": rows,
        },
    )
    bad = [(r["model"], p) for r in rows for p in r["problems"]]
    for model, problem in bad:
        print(f"{model}: {problem}", file=sys.stderr)
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
