"""Reductions wider than int32 holds without a pre-shift, compiled: bit-exact with the reference.

    python bench/wide_reductions.py                       # the 28x28 CNNs at batch 256, ResNet-18
    python bench/wide_reductions.py --cases ResNet18@224x32 --steps 2 --plans cpu,gpu

At batch 256 on 28x28 input, the weight gradient of a convolution and a batch norm's dgamma sum
N*H*W = 200704 > 2^17 products of int8 mantissas: product_cap < 0, so one operand is pre-shifted
with rounding (docs/numerics.md section 6). Each case compiles the model's training step for
the host (`llvm`, plan "cpu") and the GPU launch plan run on the host (plan "gpu": the same TIR
the CUDA artifact is built from, docs/cuda.md), trains `--steps` steps on one random batch beside
the reference executor and compares loss and state checksum after every step. Writes
bench/results/wide_reductions.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.resnet import ResNet18  # noqa: E402
from mexc.backends.llvm.step import LlvmProgram  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

MODELS: dict[str, Any] = {**{k: v[0] for k, v in EXAMPLES.items()}, "ResNet18": ResNet18}
CASES = "FashionCNN@28x256,SmallResNet@28x256,MobileNetV2Tiny@28x256,ResNet18@224x32"


def run_case(case: str, steps: int, plans: list[str]) -> dict[str, Any]:
    name, geometry = case.split("@")
    side, batch = (int(v) for v in geometry.split("x"))
    channels = 3 if name == "ResNet18" else 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, channels, side, side)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = mexc.compile(model, (torch.from_numpy(x),))
    row: dict[str, Any] = {"case": case, "batch": batch, "input": [channels, side, side]}
    t0 = time.perf_counter()
    progs = {p: LlvmProgram(ref.retargeted("llvm"), plan_device=p) for p in plans}
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    names = {p: [launch[0] for launch in progs[p].plan["launches"]] for p in plans}
    row["pre_shifts"] = {p: sum(s.endswith(("_pre3", "_pre7")) for s in names[p]) for p in plans}
    row["steps"], exact = [], True
    for step in range(steps):
        t0 = time.perf_counter()
        want = ref.step(x, y)
        entry: dict[str, Any] = {"step": step, "reference_s": round(time.perf_counter() - t0, 1)}
        for p, prog in progs.items():
            got = prog.step(x, y)
            same = got == want and prog.state_checksum() == ref.state_checksum()
            entry[p] = {"loss": got, "exact": same}
            exact &= same
        entry["reference_loss"] = want
        row["steps"].append(entry)
        print(f"{case} step {step}: {entry}", flush=True)
    row["bit_exact"] = exact
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="MODEL@SIDExBATCH, comma-separated")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--plans", default="cpu,gpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "wide_reductions.json"))
    args = ap.parse_args()
    rows = [run_case(c, args.steps, args.plans.split(",")) for c in args.cases.split(",")]
    write_json_atomic(args.out, {**provenance("mexc-wide-reductions-1"), "rows": rows})
    for r in rows:
        print(f"{r['case']:<26} pre-shifts {r['pre_shifts']}  bit-exact {r['bit_exact']}")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
