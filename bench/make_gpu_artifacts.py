"""Build the artifacts that bench/gpu_check.sh runs on a GPU machine (which has no TVM or nvcc).

    python bench/make_gpu_artifacts.py [--arch sm_90] [--out build/gpu]

For the Fashion CNN (batch 128) and ResNet-18 (batch 4, so that the host reference stays quick)
it writes the product kernels (`products.cu`, the cubin, `products.json`) and `expected.json`:
SHA-256 digests of every kernel set's accumulator on deterministic operands, computed on the host
through TVM's llvm build of the same GEMM forms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import FashionCNN  # noqa: E402
from examples.resnet import ResNet18  # noqa: E402
from mexc.codegen.cuda_build import build_products, write_expected  # noqa: E402

TARGETS = {
    "fashion": (FashionCNN, (1, 28, 28), 128),
    "resnet18": (ResNet18, (3, 32, 32), 4),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default=str(ROOT / "build" / "gpu"))
    args = ap.parse_args(argv)
    for name, (cls, shape, batch) in TARGETS.items():
        t0 = time.perf_counter()
        torch.manual_seed(0)
        prog = mexc.compile(cls(), (torch.zeros(batch, *shape),))
        folder = Path(args.out) / f"{name}-{args.arch}"
        man = build_products(prog, args.arch, folder)
        exp = write_expected(prog, folder)
        print(
            f"{folder}: {len(man['products'])} products, {len(exp['kernel_sets'])} kernel sets, "
            f"{time.perf_counter() - t0:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
