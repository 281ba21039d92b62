"""State checksums of every example model on every backend, after a few training steps.

    python bench/checksums.py                      # every model, every backend that builds it
    python bench/checksums.py --out before.json    # keep them, to diff after a refactor

Each model (examples/models.py, ResNet-18 at 32x32, the ViT of examples/vit.py) is compiled at
batch 4 with SGD (momentum, weight decay, cosine schedule) and trained `--steps` steps on one
fixed random batch on: the reference, llvm, c (the generated C built by the host compiler) and
cuda (the artifact's own CUDA source on the CPU emulator). A backend that refuses a model is
listed with its refusal. The printed table has the final state checksum per model and backend;
every backend's column must equal the reference's. Needs TVM, a C compiler and nvcc.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.resnet import ResNet18  # noqa: E402
from examples.vit import ViTTiny  # noqa: E402

MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {
    **EXAMPLES,
    "ResNet18": (ResNet18, (3, 32, 32)),
    "ViTTiny": (ViTTiny, (1, 28, 28)),
}
BACKENDS = ("reference", "llvm", "c", "cuda")


def _program(name: str, batch: int, target: str) -> mexc.Program:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, 2))
    return mexc.compile(cls(), (torch.zeros(batch, *shape),), optimizer=opt, target=target)


def _emulated(name: str, batch: int) -> mexc.Program:
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import load_emulated

    tmp = tempfile.mkdtemp()
    build_step(_program(name, batch, "reference"), ("sm_80",), tmp)
    return load_emulated(tmp)


def checksum(name: str, backend: str, batch: int, steps: int) -> str:
    try:
        prog = _emulated(name, batch) if backend == "cuda" else _program(name, batch, backend)
    except mexc.UnsupportedOpError as err:
        return "refused: " + str(err).split(". ")[0][:60]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *MODELS[name][1])).astype(np.float32)
    y = rng.integers(0, 10, batch)
    for _ in range(steps):
        prog.step(x, y)
    return prog.state_checksum()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", help="write {model: {backend: checksum}} as JSON")
    args = ap.parse_args(argv)
    table: dict[str, dict[str, str]] = {}
    bad = []
    for name in args.models.split(","):
        row = {b: checksum(name, b, args.batch, args.steps) for b in args.backends.split(",")}
        table[name] = row
        ref = row.get("reference")
        bad += [f"{name}/{b}" for b, c in row.items() if not c.startswith("refused") and c != ref]
        print(name, json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    if bad:
        print(f"differs from the reference: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
