"""Training memory of mexc beside PyTorch FP32, measured, per model and batch size.

    python bench/memory.py                                  # every example, ViT-tiny, ResNet-18
    python bench/memory.py --models FashionCNN --batches 32,128 --no-rss

For each model and batch (default 32 and 128):

- `fp32`: PyTorch FP32 eager's bytes for one training step (SGD with momentum): parameters,
  buffers and momentum, plus the peak of the tensor bytes a step allocates (activations saved
  for the backward pass, gradients, temporaries), from the torch profiler's memory events;
- `reference`: the numpy executor's state plus the peak of numpy's allocations during one step
  (tracemalloc: kernel temporaries included);
- `llvm`: the bytes the compiled CPU step allocates (its state region and arena; "-" where the
  model has an op llvm does not lower yet);
- `c`: the static arrays of the generated C (arena, scratch, state), as an MCU links them;
- `cuda`: the device bytes of the CUDA artifact's layout (mexc.backends.cuda.build.device_layout:
  state region, arena, kernel scratch), without nvcc;
- with RSS (default on; each figure the median of RSS_RUNS fresh processes, at the batches
  of `--rss-batches`, default 32 and 256): the peak resident set per extra sample of a fresh
  process that trains 3 steps with mexc (target "auto": llvm, or the reference where llvm
  does not lower the model; compile from a warm kernel cache, then steps) and in FP32 eager,
  ((peak at the larger batch) - (peak at the smaller)) / (batch difference): fixed costs
  (interpreter, libraries, kernels) cancel.

Ratios are mexc's bytes over FP32's. Prints a table; writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import subprocess
import sys
import tracemalloc
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
from mexc.backends.reference.interp import value_bytes  # noqa: E402
from mexc.fp32 import step_memory  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {
    **EXAMPLES,
    "ViTTiny": (ViTTiny, (1, 28, 28)),
    "ResNet18": (ResNet18, (3, 32, 32)),
}
STEPS = 3  # steps of an RSS child
RSS_RUNS = 3  # fresh processes per batch and contender (their median)


def _batch(shape: tuple[int, ...], batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    return x, rng.integers(0, 10, batch)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def reference_bytes(prog: mexc.Program, x: np.ndarray, y: np.ndarray) -> int:
    """State plus numpy's peak allocation during one reference step (tracemalloc)."""
    state = sum(value_bytes(v) for v in prog.state.values())
    gc.collect()
    tracemalloc.start()
    try:
        prog.step(x, y)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return state + peak


def c_bytes(prog: mexc.Program) -> int:
    from mexc.backends.c.emit import emit_model

    return emit_model(prog, 1).static_bytes


def cuda_bytes(prog: mexc.Program) -> int:
    from mexc.backends.cuda.build import device_layout

    layout = device_layout(prog)
    return int(layout["state_bytes"] + layout["arena_bytes"])


def measure(name: str, batch: int, targets: list[str]) -> dict[str, Any]:
    shape = MODELS[name][1]
    x, y = _batch(shape, batch)
    model = _model(name)
    row: dict[str, Any] = {"model": name, "batch": batch}
    fp32 = step_memory(copy.deepcopy(model), torch.from_numpy(x), torch.from_numpy(y))
    row["fp32"] = fp32
    prog = mexc.compile(model, (torch.from_numpy(x),))
    got: dict[str, int | None] = {}
    if "reference" in targets:
        got["reference"] = reference_bytes(prog, x, y)
    if "llvm" in targets:
        try:
            got["llvm"] = _llvm_bytes(prog)
        except mexc.UnsupportedOpError:
            got["llvm"] = None
    if "c" in targets:
        got["c"] = c_bytes(prog)
    if "cuda" in targets:
        try:
            got["cuda"] = cuda_bytes(prog)
        except mexc.UnsupportedOpError:
            got["cuda"] = None
    row["mexc_bytes"] = got
    row["ratio"] = {k: (v / fp32["peak_bytes"] if v else None) for k, v in got.items()}
    plan = prog.memory_report()
    row["planned_bytes"] = plan["planned_persistent_bytes"] + plan["planned_arena_bytes"]
    row["formula_int_bytes"], row["formula_fp32_bytes"] = (
        plan["formula_int_bytes"],
        plan["formula_fp32_bytes"],
    )
    return row


def _llvm_bytes(prog: mexc.Program) -> int:
    from mexc.backends.llvm.step import LlvmProgram

    return int(LlvmProgram(prog.retargeted("llvm")).allocated_bytes()["host"])


# ----------------------------------------------------------------------------- RSS children


def _peak_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(name: str, batch: int, who: str) -> int:
    """Peak RSS (KiB) of a process that builds `name` and trains STEPS steps at `batch` with
    `who` ("mexc": compiled by mexc for target "auto", whose target it prints first; "fp32":
    PyTorch eager)."""
    x, y = _batch(MODELS[name][1], batch)
    model = _model(name)
    if who == "fp32":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        for _ in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt), yt).backward()
            opt.step()
    else:
        prog = mexc.compile(model, (torch.from_numpy(x),), target="auto")
        for _ in range(STEPS):
            prog.step(x, y)
        print(prog.options.target)
    return _peak_rss_kib()


def rss_slope(name: str, batches: list[int], who: str) -> dict[str, Any]:
    """Per-sample peak-RSS growth from fresh processes at the smallest and largest batch, each
    the median of RSS_RUNS processes: the fixed part of a fresh process's peak (the libraries,
    about 515 MiB for mexc) varies by up to 13 MiB between runs, more than a small model's
    whole per-sample growth."""
    peaks, runs, target = {}, {}, "fp32"
    for b in (min(batches), max(batches)):
        cmd = [sys.executable, __file__, "--child", name, str(b), who]
        runs[b] = []
        for _ in range(RSS_RUNS):
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            lines = out.stdout.strip().splitlines()
            runs[b].append(int(lines[-1]))
            target = lines[-2] if who != "fp32" else target
        peaks[b] = int(np.median(runs[b]))
    lo, hi = min(batches), max(batches)
    return {
        "target": target,
        "peak_rss_kib": peaks,
        "runs_kib": runs,
        "kib_per_sample": (peaks[hi] - peaks[lo]) / (hi - lo),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--targets", default="reference,llvm,c,cuda")
    # RSS slopes over a wider span than the table's: FP32's peak RSS at one batch moved by up to
    # 14 MiB between fresh processes (FashionCNN, 128), as much as half its growth from 32 to 128
    ap.add_argument("--rss-batches", default="32,256")
    ap.add_argument("--no-rss", action="store_true", help="skip the RSS children")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "BATCH", "WHO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(child(args.child[0], int(args.child[1]), args.child[2]))
        return
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    targets = args.targets.split(",")
    rows = [measure(m, b, targets) for m in models for b in batches]
    rss: dict[str, Any] = {}
    write_json_atomic(args.out, {**provenance("mexc-memory-1"), "rows": rows, "rss": rss})
    if not args.no_rss:
        for m in models:
            span = [int(b) for b in args.rss_batches.split(",")]
            rss[m] = {who: rss_slope(m, span, who) for who in ("mexc", "fp32")}
            mexc_s, fp_s = rss[m]["mexc"]["kib_per_sample"], rss[m]["fp32"]["kib_per_sample"]
            rss[m]["ratio"] = mexc_s / fp_s if fp_s > 0 else None
    mib = 1 << 20
    head = f"{'model':<16} {'batch':>5} {'FP32 MiB':>9} "
    print(head + " ".join(f"{t + ' MiB (x)':>14}" for t in targets))
    for r in rows:
        cells = []
        for t in targets:
            v, q = r["mexc_bytes"].get(t), r["ratio"].get(t)
            cells.append(f"{v / mib:7.2f} ({q:.2f})" if v else f"{'-':>14}")
        fp = r["fp32"]["peak_bytes"] / mib
        print(f"{r['model']:<16} {r['batch']:>5} {fp:9.2f} " + " ".join(f"{c:>14}" for c in cells))
    for m, d in rss.items():
        q = d["ratio"]
        print(
            f"RSS per sample {m:<16} mexc ({d['mexc']['target']}) "
            f"{d['mexc']['kib_per_sample']:7.1f} KiB  "
            f"FP32 {d['fp32']['kib_per_sample']:7.1f} KiB  ratio {q:.2f}"
            if q is not None
            else f"RSS per sample {m:<16} (FP32 slope not positive)"
        )
    doc = {**provenance("mexc-memory-1"), "rows": rows, "rss": rss}
    write_json_atomic(args.out, doc)
    print(f"written {args.out}")
    sys.stdout.flush()
    os._exit(0)  # TVM's thread pool can stall interpreter shutdown


if __name__ == "__main__":
    main()
