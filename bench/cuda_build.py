"""Offline CUDA build of the product kernels: time, kernel count and SASS check per model and arch.

    python bench/cuda_build.py                         # every example model, ViT-tiny, ResNet-18
    python bench/cuda_build.py --models ResNet18 --archs sm_90

For each model (batch 128) and architecture it generates the product kernels with TVM, compiles
them with nvcc, and reads the SASS back: the table shows the products, the distinct kernel sets
(products of equal geometry share kernels), TVM and nvcc seconds, the fewest IDP.4A / IMMA
instructions found in any GEMM kernel, and floating-point instructions in any kernel (must be 0).
Writes bench/results/cuda_build.json. Needs nvcc and `pip install -e .[cuda-tools]`; no GPU.
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
from mexc.codegen.cuda_build import build_products  # noqa: E402
from mexc.codegen.nvcc import ARCHS, float_opcodes, integer_mma, sass_opcodes  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {
    **EXAMPLES,
    "ViTTiny": (ViTTiny, (1, 28, 28)),
    "ResNet18": (ResNet18, (3, 32, 32)),
}


def measure(name: str, arch: str, batch: int) -> dict[str, Any]:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    prog = mexc.compile(cls(), (torch.zeros(batch, *shape),))
    compile_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        man = build_products(prog, arch, tmp)
        ops = sass_opcodes(Path(tmp) / man["cubin"])
    gemm = [integer_mma(v) for k, v in ops.items() if k.endswith("_gemm_kernel")]
    return {
        "model": name,
        "arch": arch,
        "batch": batch,
        "products": len(man["products"]),
        "kernel_sets": len(man["kernel_sets"]),
        "kernels": len(ops),
        "mexc_compile_s": round(compile_s, 2),
        "tvm_s": man["seconds"]["tvm"],
        "nvcc_s": man["seconds"]["nvcc"],
        "min_int_mma_per_gemm": min(gemm),
        "float_instructions": sum(len(float_opcodes(v)) for v in ops.values()),
        "gmacs_per_step": round(sum(p["macs"] for p in man["products"]) / 1e9, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda_build.json"))
    args = ap.parse_args(argv)
    rows = [
        measure(m.strip(), a.strip(), args.batch)
        for m in args.models.split(",")
        for a in args.archs.split(",")
    ]
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-cuda-build-1", ["python", *sys.argv]),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
