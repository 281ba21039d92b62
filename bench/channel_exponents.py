"""What channel exponents (docs/numerics.md section 5) cost on the llvm backend, in one run.

For each model at B bits and batch 128: the training step with and without channel exponents,
timed in alternating blocks (A B A B, a pause before each block so that one contender's idle TVM
threads do not spin on the other's cores), and the bytes the compiled step allocates
(`memory_report()["allocated_bytes"]`: state region and arena). Writes
bench/results/channel_exponents.json.

    python bench/channel_exponents.py [--models FashionCNN,SmallResNet] [--bits 4]
                                      [--blocks 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402


def _program(name: str, batch: int, bits: int, channels: bool) -> mexc.Program:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.02, momentum=0.9, weight_decay=5e-4)
    x = torch.zeros(batch, *shape)
    return mexc.compile(cls(), (x,), opt, bits=bits, target="llvm", channel_exponents=channels)


def measure(name: str, batch: int, bits: int, blocks: int, steps: int, pause: float) -> dict:
    progs = {c: _program(name, batch, bits, c) for c in (False, True)}
    rng = np.random.default_rng(0)
    _, shape = EXAMPLES[name]
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    for p in progs.values():
        p.step(x, y)  # warm-up: first-touch pages, thread pool
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(blocks):
        for channels, p in progs.items():
            time.sleep(pause)
            for _ in range(steps):
                t0 = time.perf_counter()
                p.step(x, y)
                times[channels].append(time.perf_counter() - t0)
    row: dict = {"model": name, "batch": batch, "bits": bits}
    for channels, p in progs.items():
        tag = "channels" if channels else "tensor"
        row[f"{tag}_step_s"] = round(statistics.median(times[channels]), 5)
        row[f"{tag}_allocated_bytes"] = p.memory_report()["allocated_bytes"]
    row["time_ratio"] = round(row["channels_step_s"] / row["tensor_step_s"], 3)
    row["bytes_ratio"] = round(row["channels_allocated_bytes"] / row["tensor_allocated_bytes"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="FashionCNN,SmallResNet")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "channel_exponents.json"))
    args = ap.parse_args(argv)
    rows = [
        measure(m, args.batch, args.bits, args.blocks, args.steps, args.pause)
        for m in args.models.split(",")
    ]
    print(f"{'model':>16} {'B':>2} {'tensor s':>9} {'channels s':>10} {'ratio':>6} "
          f"{'tensor MB':>9} {'channels MB':>11} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:>16} {r['bits']:>2} {r['tensor_step_s']:>9.4f} "
            f"{r['channels_step_s']:>10.4f} {r['time_ratio']:>6.2f} "
            f"{r['tensor_allocated_bytes'] / 1e6:>9.2f} "
            f"{r['channels_allocated_bytes'] / 1e6:>11.2f} {r['bytes_ratio']:>6.2f}"
        )
    write_json_atomic(args.out, {**provenance("mexc-bench-channel-exponents-1"), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
