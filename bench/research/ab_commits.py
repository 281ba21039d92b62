"""The llvm training step of two versions of mexc side by side: is a change faster or slower?

    git worktree add --detach /tmp/old e20eac5
    python bench/research/ab_commits.py --old /tmp/old --models FashionCNN,SmallResNet

For each model at `--batch`: one worker process imports the old tree (`--old`, a checkout of the
earlier commit), one this tree; each compiles the example with target "llvm" and trains one
step. Then they take turns: a block of `--steps` steps in one, a pause of `--pause` seconds (so
that one contender's idle threads stop spinning on the other's cores), a block in the other,
`--blocks` times. Prints the median step of each and new / old, and the bytes each allocates.
The two trees must not share a kernel cache entry: the cache key hashes the lowering sources,
so two versions that differ there never do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import mexc
from examples.models import EXAMPLES
from examples.vit import ViTTiny
models = {**EXAMPLES, "ViTTiny": (ViTTiny, (1, 28, 28))}
cls, shape = models[sys.argv[2]]
batch = int(sys.argv[3])
torch.manual_seed(0)
prog = mexc.compile(cls(), (torch.zeros(batch, *shape),), target="llvm")
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, *shape)).astype(np.float32)
y = rng.integers(0, 10, batch)
prog.step(x, y)
print("ready", prog.memory_report()["allocated_bytes"], flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    for _ in range(int(line)):
        prog.step(x, y)
    print((time.perf_counter() - t0) / int(line), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a checkout of the earlier commit")
    ap.add_argument("--models", default="FashionCNN,DigitsCNN,SmallResNet,MobileNetV2Tiny")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--pause", type=float, default=0.5)
    args = ap.parse_args()
    for model in args.models.split(","):
        procs = {}
        for tag, root in (("old", args.old), ("new", str(ROOT))):
            procs[tag] = subprocess.Popen(
                [sys.executable, "-c", WORKER, root, model, str(args.batch)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=root),
                cwd=root,
            )
        allocated = {tag: p.stdout.readline().split()[1] for tag, p in procs.items()}
        times: dict[str, list[float]] = {tag: [] for tag in procs}
        for _ in range(args.blocks):
            for tag, p in procs.items():
                p.stdin.write(f"{args.steps}\n")
                p.stdin.flush()
                times[tag].append(float(p.stdout.readline()))
                time.sleep(args.pause)
        for p in procs.values():
            p.stdin.close()
            p.wait()
        old, new = (statistics.median(times[t]) for t in ("old", "new"))
        print(
            f"{model} batch {args.batch}: old {old * 1e3:.2f} ms ({allocated['old']} B), "
            f"new {new * 1e3:.2f} ms ({allocated['new']} B), new / old {new / old:.3f}"
        )


if __name__ == "__main__":
    main()
