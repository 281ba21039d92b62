"""Where a compiled (llvm) training step spends its time, by kernel kind.

For each model (those of bench/step_time.py) at batch 128 (`--batch`): the median step time,
then every launch of the step timed on its own (`LlvmProgram.kernel_times`, best of `--repeats`
steps per launch) and summed by kind (the last word of the kernel's symbol: gemm, apply, shift,
pack_b, ...), and the slowest launches.

    python bench/kernel_times.py [--models FashionCNN,SmallResNet,MobileNetV2Tiny] [--top 8]
                                 [--batch 128]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from bench.step_time import MODELS  # noqa: E402  (one list of benchmark models)
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

KINDS = {"a": "pack_a", "b": "pack_b / interleave_b"}  # symbols ending in _pack_a / _pack_b


def kind_of(symbol: str) -> str:
    last = symbol.rsplit("_", 1)[-1]
    return KINDS.get(last, last)


def measure(name: str, repeats: int, top: int, batch: int) -> dict[str, object]:
    cls, shape = MODELS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (x,), target="llvm")
    for _ in range(2):
        prog.step(x, y)
    steps = []
    for _ in range(7):
        time.sleep(0.1)
        t0 = time.perf_counter()
        prog.step(x, y)
        steps.append(time.perf_counter() - t0)
    times = prog.kernel_times(x, y, repeats=repeats)  # type: ignore[attr-defined]
    kinds: collections.Counter[str] = collections.Counter()
    for key, sec in times.items():
        kinds[kind_of(key.split(" ", 1)[1])] += sec
    slowest = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {
        "model": name,
        "step_s": float(np.median(steps)),
        "kernels_s": sum(times.values()),
        "launches": len(times),
        "by_kind_s": dict(kinds.most_common()),
        "slowest": [[k, v] for k, v in slowest],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="FashionCNN,SmallResNet,MobileNetV2Tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench/results/kernel_times.json"))
    args = ap.parse_args()
    results = []
    for name in args.models.split(","):
        r = measure(name, args.repeats, args.top, args.batch)
        results.append(r)
        print(
            f"\n{name}: step {r['step_s'] * 1e3:.1f} ms (median of 7), kernels "
            f"{r['kernels_s'] * 1e3:.1f} ms over {r['launches']} launches"
        )
        for kind, sec in r["by_kind_s"].items():  # type: ignore[attr-defined]
            print(f"  {kind:24} {sec * 1e3:7.2f} ms")
        print("  slowest launches:")
        for key, sec in r["slowest"]:  # type: ignore[attr-defined]
            print(f"    {sec * 1e3:7.3f} ms  {key}")
    doc = {**provenance("mexc-bench-kernel-times-1"), "batch": args.batch, "models": results}
    write_json_atomic(args.out, doc)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
