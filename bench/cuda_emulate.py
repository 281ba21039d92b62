"""Train whole CUDA training steps on the CPU emulator of their own source, against the reference.

    python bench/cuda_emulate.py                       # every example model and ResNet-18
    python bench/cuda_emulate.py --models ResNet18 --steps 3 --check

For each model it builds the CUDA artifact of the training step (sm_80, batch 2 by default: the
emulator runs every thread of every kernel on one core) and trains `--steps` steps on one random
batch through mexc.backends.cuda.emulator, with blocks and threads in launch order and in
reverse order (the two in two processes), beside the reference interpreter. The table shows the
build seconds, the emulated seconds per step and whether every step's loss and state checksum
equal the reference's, and how many rules of cuda_verify the SASS of every `--archs` breaks.
Writes bench/results/cuda_emulate.json; with --check it exits 1 on any difference or broken
rule (CI runs it for the models the test suite leaves out). Needs TVM, nvcc and g++; no GPU.
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
from mexc.backends.cuda.emulator import ORDER_LAYOUT, compare  # noqa: E402
from mexc.backends.cuda.sass_check import verify_artifact  # noqa: E402
from mexc.lowering.workers import forked_map  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {
    **EXAMPLES,
    "ResNet18": (ResNet18, (3, 32, 32)),
    "ViTTiny": (ViTTiny, (1, 28, 28)),
}


def _program(name: str, batch: int) -> mexc.Program:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, 2))
    return mexc.compile(cls(), (torch.zeros(batch, *shape),), optimizer=opt)


def _emulate_order(order: str, shared: dict[str, Any]) -> list[dict]:
    """compare() of the artifact in shared["dir"], blocks and threads in `order`."""
    return compare(shared["dir"], shared["steps"], order == "reverse", layout=ORDER_LAYOUT[order])


def measure(name: str, batch: int, steps: int, archs: tuple[str, ...]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        man = build_step(_program(name, batch), archs, tmp)
        build_s = time.perf_counter() - t0
        problems = verify_artifact(Path(tmp), man)  # integer-only SASS, tensor-core GEMMs
        # the two orders in forked processes, one per CPU: each emulates on one core
        names = ["forward", "reverse"]
        shared = {"dir": tmp, "steps": steps}
        orders = dict(zip(names, forked_map(_emulate_order, names, shared)))
    exact = all(r["exact"] for rows in orders.values() for r in rows)
    per_step = [r["seconds"] for rows in orders.values() for r in rows]
    return {
        "model": name,
        "batch": batch,
        "kernel_launches": len(man["kernels"]),
        "build_s": round(build_s, 1),
        "emulated_s_per_step": round(sorted(per_step)[len(per_step) // 2], 1),
        "steps": steps,
        "bit_exact_both_orders": exact,
        "sass_problems": len(problems),
        "final_checksum": orders["forward"][-1]["checksum"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--archs", default="sm_80", help="built and checked; sm_80 is emulated")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every model is exact")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda_emulate.json"))
    args = ap.parse_args(argv)
    archs = tuple(a.strip() for a in args.archs.split(","))
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name.strip(), args.batch, args.steps, archs))
        print(rows[-1], flush=True)
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
    doc = {**provenance("mexc-bench-cuda-emulate-1", ["python", *sys.argv]), "rows": rows}
    write_json_atomic(args.out, doc)
    bad = [r["model"] for r in rows if not r["bit_exact_both_orders"]]
    if bad:
        print(f"not bit-exact under emulation: {bad}", file=sys.stderr)
    broken = [r["model"] for r in rows if r["sass_problems"]]
    if broken:
        print(
            f"SASS breaks cuda_verify's rules (bench/cuda_build.py says how): {broken}",
            file=sys.stderr,
        )
    return 1 if args.check and (bad or broken) else 0


if __name__ == "__main__":
    sys.exit(main())
