"""Training-step time of mexc beside PyTorch FP32 eager, interleaved in one run.

For each model (examples/models.py, the ViT of examples/vit.py, and that ViT in timm's
ViT-Ti configuration) at batch 128: the median wall time of one training step of mexc (`llvm`, the
step compiled by TVM for this CPU; `reference`, the numpy executor; optionally `c`, the generated
C built with the host compiler) and of PyTorch FP32 eager (same model, SGD with momentum),
measured in alternation so machine noise hits all alike; compile time of each target cold (empty
cache) and again from the cache. PyTorch and TVM use the same number of threads. Prints a table
with ratios; writes bench/results/step_time.json.

    python bench/step_time.py [--models FashionCNN,...] [--targets llvm,reference] [--repeats 7]
                              [--baseline]

--baseline adds the contender `llvm-unplanned`: the same compiled kernels with one allocation
per plan buffer and no batch chunks of the products, as before the arena layout (docs/cpu.md):
the arena's effect on the step, measured in the same interleaved run.
"""

from __future__ import annotations

import os

# numpy's BLAS threads (the reference executor's float32 products), TVM's pool workers and
# PyTorch's OpenMP threads spin for a while after each call; interleaved, they would steal the
# next contender's cores (measured on the Fashion CNN: FP32 eager 0.073 s beside them instead of
# 0.041 s alone). So every timed step starts after a pause (--settle) in which the previous
# contender's threads go idle, and each runs with its default threading, as it would alone; one
# BLAS thread (only the reference uses BLAS). An earlier version kept TVM's workers from
# spinning at all instead (TVM_THREAD_POOL_SPIN_COUNT=0): that makes every parallel kernel of
# the compiled step wake sleeping threads (measured: FashionCNN llvm 0.0535 s against 0.0448 s
# with the default, FP32 0.049 / 0.050 s).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.vit import ViTTiny  # noqa: E402

MODELS: dict[str, tuple[type[nn.Module] | functools.partial[nn.Module], tuple[int, ...]]] = {
    **EXAMPLES,
    "ViTTiny": (ViTTiny, (1, 28, 28)),  # examples/vit.py: dim 64, depth 2, 16 tokens
    # timm's vit_tiny_patch16 configuration (dim 192, depth 12, 3 heads, MLP ratio 4) on 28x28
    # images in patches of 4 (49 tokens)
    "ViT-Ti": (
        functools.partial(ViTTiny, dim=192, depth=12, heads=3, mlp_ratio=4, patch=4),
        (1, 28, 28),
    ),
}


def _fp32_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


UNPLANNED = "llvm-unplanned"


def measure(
    name: str, batch: int, repeats: int, targets: list[str], settle: float, baseline: bool = False
) -> dict[str, object]:
    cls, shape = MODELS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    torch.manual_seed(0)
    model = cls()
    progs = {}
    cached: dict[str, float] = {}
    for target in targets:
        t0 = time.perf_counter()
        try:
            progs[target] = mexc.compile(model, (x,), target=target)
        except mexc.UnsupportedOpError:
            continue
        progs[target + " compile s"] = time.perf_counter() - t0  # type: ignore[assignment]
        t0 = time.perf_counter()
        again = mexc.compile(model, (x,), target=target)  # from the cache where there is one
        cached[target] = time.perf_counter() - t0
        del again
        progs[target].step(x, y)  # warm up
    if baseline and "llvm" in progs:
        from mexc.backends.llvm.step import LlvmProgram

        t0 = time.perf_counter()
        ref = mexc.compile(model, (x,), target="reference")
        unplanned = LlvmProgram(ref.retargeted("llvm"), layout="separate", pack_budget=1 << 62)
        progs[UNPLANNED + " compile s"] = time.perf_counter() - t0  # type: ignore[assignment]
        cached[UNPLANNED] = 0.0
        unplanned.step(x, y)
        progs[UNPLANNED] = unplanned
        targets = [*targets, UNPLANNED]
    fp32 = cls().train()
    opt = torch.optim.SGD(fp32.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    _fp32_step(fp32, opt, xt, yt)
    times: dict[str, list[float]] = {k: [] for k in [*targets, "fp32"] if k in progs or k == "fp32"}
    for _ in range(repeats):
        for key in times:
            time.sleep(settle)  # the previous contender's idle threads stop spinning
            t0 = time.perf_counter()
            if key == "fp32":
                _fp32_step(fp32, opt, xt, yt)
            else:
                progs[key].step(x, y)  # type: ignore[union-attr]
            times[key].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "model": name,
        "batch": batch,
        "median_s": med,
        "ratio_to_fp32": {k: med[k] / med["fp32"] for k in med if k != "fp32"},
        "compile_s": {k[:-10]: v for k, v in progs.items() if k.endswith(" compile s")},
        "compile_again_s": cached,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="FashionCNN,SmallResNet,MobileNetV2Tiny")
    ap.add_argument("--targets", default="llvm,reference")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--settle", type=float, default=0.1, help="seconds of pause before each timed step"
    )
    ap.add_argument("--baseline", action="store_true", help=f"add the {UNPLANNED} contender")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_time.json"))
    args = ap.parse_args()
    targets = args.targets.split(",")
    if "llvm" in targets:  # a cold compile: the cache is this run's own
        os.environ["MEXC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mexc-bench-cache-")
        os.environ["TVM_NUM_THREADS"] = str(torch.get_num_threads())  # same threads as PyTorch
    rows = [
        measure(m, args.batch, args.repeats, targets, args.settle, args.baseline)
        for m in args.models.split(",")
    ]
    head = f"{'model':<16} {'target':<14} {'median step s':>14} {'/ FP32 eager':>13}"
    print(f"{head} {'compile s':>10} {'again s':>8}")  # again: from the kernel cache
    for r in rows:
        med, comp, again = r["median_s"], r["compile_s"], r["compile_again_s"]
        assert isinstance(med, dict) and isinstance(comp, dict) and isinstance(again, dict)
        for key, value in med.items():
            ratio = value / med["fp32"]
            c = f"{comp[key]:>10.1f} {again[key]:>8.1f}" if key in comp else ""
            print(f"{r['model']:<16} {key:<14} {value:>14.4f} {ratio:>13.2f} {c}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.platform(),
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
