"""Inference throughput (images/s) of mexc predict beside PyTorch FP32 eval, interleaved.

For each model, compiled at batch 128 and trained a few steps (so that the batch-norm running
statistics are not the initial ones): images per second of `predict` over N rows (default
1000: not a multiple of the batch, so the padded last batch is in the measurement) for mexc
`llvm` (the compiled inference plan, docs/cpu.md), mexc `reference` (the numpy executor) and
PyTorch FP32 eval (`model.eval()`, `torch.no_grad()`, argmax of the logits), measured in
alternation with a pause before each (bench/step_time.py explains why). Checks that llvm's
predictions equal the reference's. The first llvm predict (which compiles the inference plan)
is timed on its own as `compile s`. Prints a table; writes bench/results/inference.json.

    python bench/inference.py [--models FashionCNN,...] [--rows 1000] [--repeats 5]
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench/step_time.py
# a cold compile: this run's own kernel cache (read when mexc is imported, so set it first)
os.environ["MEXC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mexc-bench-cache-")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402


def measure(
    name: str, batch: int, rows: int, repeats: int, settle: float, train_steps: int
) -> dict[str, object]:
    cls, shape = EXAMPLES[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    xe = rng.standard_normal((rows, *shape)).astype(np.float32)
    torch.manual_seed(0)
    model = cls()
    progs = {t: mexc.compile(model, (x,), target=t) for t in ("llvm", "reference")}
    for _ in range(train_steps):
        for p in progs.values():
            p.step(x, y)
    t0 = time.perf_counter()
    first = progs["llvm"].predict(xe[:1])  # compiles the inference plan
    compile_s = time.perf_counter() - t0
    assert np.array_equal(first, progs["reference"].predict(xe[:1]))
    same = bool(np.array_equal(progs["llvm"].predict(xe), progs["reference"].predict(xe)))
    fp32 = cls().eval()
    xt = torch.from_numpy(xe)

    def torch_predict() -> np.ndarray:
        with torch.no_grad():
            return torch.cat([fp32(c).argmax(1) for c in xt.split(batch)]).numpy()

    torch_predict()
    run = {"llvm": progs["llvm"].predict, "reference": progs["reference"].predict}
    times: dict[str, list[float]] = {"llvm": [], "reference": [], "fp32": []}
    for _ in range(repeats):
        for key in times:
            time.sleep(settle)
            t0 = time.perf_counter()
            torch_predict() if key == "fp32" else run[key](xe)
            times[key].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "model": name,
        "batch": batch,
        "rows": rows,
        "images_per_s": {k: rows / v for k, v in med.items()},
        "median_s": med,
        "llvm_equals_reference": same,
        "llvm_inference_compile_s": compile_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="FashionCNN,SmallResNet,MobileNetV2Tiny,MLP")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settle", type=float, default=0.1)
    ap.add_argument("--train-steps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "inference.json"))
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(torch.get_num_threads())  # same threads as PyTorch
    rows = [
        measure(m, args.batch, args.rows, args.repeats, args.settle, args.train_steps)
        for m in args.models.split(",")
    ]
    print(
        f"{'model':<16} {'llvm img/s':>11} {'reference':>10} {'FP32 eval':>10} "
        f"{'llvm/FP32':>9} {'llvm/ref':>8} {'compile s':>9} {'bit-exact':>9}"
    )
    for r in rows:
        ips = r["images_per_s"]
        assert isinstance(ips, dict)
        print(
            f"{r['model']:<16} {ips['llvm']:>11.0f} {ips['reference']:>10.0f} "
            f"{ips['fp32']:>10.0f} {ips['llvm'] / ips['fp32']:>9.2f} "
            f"{ips['llvm'] / ips['reference']:>8.1f} {r['llvm_inference_compile_s']:>9.1f} "
            f"{str(r['llvm_equals_reference']):>9}"
        )
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
