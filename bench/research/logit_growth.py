"""How large the logits grow while a model trains, integer-only against FP32.

    python bench/research/logit_growth.py --config fashion-mnv3 --steps 950 --every 50

Trains a `bench/accuracy.py` configuration for `--steps` steps with its recipe, data order and
initial weights, once with mexc (llvm) and once in PyTorch FP32, and prints, every `--every`
steps, the RMS and the largest magnitude of the logits both give on the step's batch in
inference mode (mexc: the accumulator logits of `Program.logits`; FP32: `model.eval()`), and
the step's training loss. The loss head's old gradient (p - 256 onehot, docs/layers.md "Output
head") made MobileNetV3-Small's integer logits grow without bound; this is the measurement.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import accuracy  # noqa: E402

from mexc.compiler import compile as compile_model  # noqa: E402
from mexc.data import batches, load_splits  # noqa: E402
from mexc.trainer import make_optimizer  # noqa: E402


def _rms_max(logits: np.ndarray) -> tuple[float, float]:
    return float(np.sqrt(np.mean(logits**2))), float(np.abs(logits).max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="fashion-mnv3", choices=sorted(accuracy.CONFIGS))
    ap.add_argument("--steps", type=int, default=950)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = accuracy.CONFIGS[args.config]
    train, _ = load_splits(cfg["data"], None, None)
    x, y = train
    if cfg.get("transform") == "rgb32":
        x = accuracy._rgb32(x)
    spe = len(y) // cfg["batch"]
    order = [
        b
        for e in range(math.ceil((args.steps + 1) / spe))
        for b in batches(len(y), cfg["batch"], args.seed, e)
    ]
    torch.manual_seed(args.seed)
    model = accuracy.MODELS[cfg["model"]]()
    fp32 = copy.deepcopy(model)
    opt = make_optimizer(0.05, 0.9, 5e-4, "cosine", spe, cfg["epochs"])
    example = torch.zeros(cfg["batch"], *x.shape[1:])
    prog = compile_model(model, (example,), optimizer=opt, seed=args.seed, target="llvm")
    sgd = torch.optim.SGD(fp32.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    print(f"{args.config}: step, mexc loss / logit RMS / max, FP32 loss / logit RMS / max")
    for s in range(args.steps + 1):
        xb, yb = x[order[s]], y[order[s]]
        if s % args.every == 0:
            fp32.eval()
            with torch.no_grad():
                f_rms, f_max = _rms_max(fp32(torch.from_numpy(xb)).numpy())
            m_rms, m_max = _rms_max(prog.logits(xb))
        for g in sgd.param_groups:
            g["lr"] = float(prog.lr_at(s))
        loss = prog.step(xb, yb)
        fp32.train()
        f_loss = torch.nn.functional.cross_entropy(
            fp32(torch.from_numpy(xb)), torch.from_numpy(yb).long()
        )
        sgd.zero_grad()
        f_loss.backward()
        sgd.step()
        if s % args.every == 0:
            print(
                f"{s:5d}  {loss:6.3f} {m_rms:8.2f} {m_max:9.1f}   "
                f"{f_loss.item():6.3f} {f_rms:8.2f} {f_max:9.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
