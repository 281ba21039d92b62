"""Where does the integer-vs-FP32 accuracy gap come from? Trains the Fashion CNN integer-only on a
slice of Fashion-MNIST, then evaluates the same final state four ways: the integer inference path
(BN running statistics), the integer forward with batch statistics, and PyTorch float on the
dequantized integer weights (running / batch statistics). Prints a table; writes
bench/results/eval_paths.json.

    OMP_NUM_THREADS=1 python bench/eval_paths.py [--train 12800] [--test 2560] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import FashionCNN  # noqa: E402
from mexc.data import batches, load_fashion_mnist  # noqa: E402
from mexc.interp import StepEnv, execute  # noqa: E402
from mexc.mx import RoundCtx  # noqa: E402
from mexc.numerics import FixedScalar  # noqa: E402


def integer_batch_stats_accuracy(prog: mexc.Program, x: np.ndarray, y: np.ndarray) -> float:
    hits = []
    zero = FixedScalar(0, 0)
    for s in range(0, len(x) - prog.batch + 1, prog.batch):
        env = StepEnv(
            RoundCtx("nearest", 0, 0, prog.options.bits),
            True,
            x[s : s + prog.batch].astype(np.float64),
            y[s : s + prog.batch],
            prog.state,
            zero,
            zero,
            zero,
            prog.batch,
        )
        logits = execute(prog._eval_nodes, env)[prog.graph.output("logits")]
        hits.append(np.argmax(logits.dequantize(), 1) == y[s : s + prog.batch])
    return float(np.concatenate(hits).mean())


def float_accuracy(prog: mexc.Program, x: np.ndarray, y: np.ndarray, batch_stats: bool) -> float:
    model = FashionCNN()
    sd = model.state_dict()
    for k in sd:
        if k in prog.state:
            sd[k] = torch.from_numpy(prog.state[k].dequantize()).float()
    model.load_state_dict(sd)
    model.train(batch_stats)
    with torch.no_grad():
        pred = np.concatenate(
            [
                model(torch.from_numpy(x[s : s + prog.batch])).argmax(1).numpy()
                for s in range(0, len(x), prog.batch)
            ]
        )
    return float((pred == y).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=12800)
    ap.add_argument("--test", type=int, default=2560)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_paths.json"))
    args = ap.parse_args()
    x, y = load_fashion_mnist("train")
    xt, yt = load_fashion_mnist("test")
    x, y, xt, yt = x[: args.train], y[: args.train], xt[: args.test], yt[: args.test]
    torch.manual_seed(0)
    batch = 128
    steps = args.epochs * (len(x) // batch)
    opt = mexc.SGD(0.05, 0.9, 5e-4, mexc.Cosine(steps, steps // 5))
    prog = mexc.compile(FashionCNN(), (torch.from_numpy(x[:batch]),), optimizer=opt)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        for idx in batches(len(x), batch, 0, epoch):
            prog.step(x[idx], y[idx])
    rows = {
        "integer, BN running statistics": prog.evaluate(xt, yt),
        "integer, BN batch statistics": integer_batch_stats_accuracy(prog, xt, yt),
        "float on integer weights, running statistics": float_accuracy(prog, xt, yt, False),
        "float on integer weights, batch statistics": float_accuracy(prog, xt, yt, True),
    }
    for name, acc in rows.items():
        print(f"{name:<46} {100 * acc:6.2f} %")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": vars(args), "train_seconds": time.perf_counter() - t0, "accuracy": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
