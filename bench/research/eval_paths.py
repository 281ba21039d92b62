"""Where does the integer-vs-FP32 accuracy gap come from? Trains the Fashion CNN integer-only on a
slice of Fashion-MNIST, then evaluates the same final state four ways: the integer inference path
(BN running statistics), the integer forward with batch statistics, and PyTorch float on the
dequantized integer weights (running / batch statistics), float with the integer path's roundings
simulated, and the integer path with 8-bit logits (before docs/numerics.md §15), counting the test
rows whose 8-bit logits tie. Prints a table; writes bench/results/eval_paths.json.

    OMP_NUM_THREADS=1 python bench/research/eval_paths.py [--train 12800] [--test 2560] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import FashionCNN  # noqa: E402
from mexc.backends.reference.interp import StepEnv, execute, infer  # noqa: E402
from mexc.data import batches, load_fashion_mnist  # noqa: E402
from mexc.kernels import quantize  # noqa: E402
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
        logits = infer(prog._eval_nodes, env, prog.graph.output("logits"))
        hits.append(np.argmax(logits.dequantize(), 1) == y[s : s + prog.batch])
    return float(np.concatenate(hits).mean())


def eight_bit_logits(prog: mexc.Program, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """Accuracy of the inference path with B-bit logits (the classifier's output compaction kept,
    argmax first index on ties, as before docs/numerics.md §15) and the number of tied rows."""
    hits, tied = [], 0
    for s in range(0, len(x) - prog.batch + 1, prog.batch):
        rows = slice(s, s + prog.batch)
        env = StepEnv(
            RoundCtx("nearest", 0, 0, prog.options.bits),
            False,
            x[rows].astype(np.float64),
            None,
            prog.state,
        )
        m = execute(prog._eval_nodes, env)[prog.graph.output("logits")].m
        tied += int(((m == m.max(1, keepdims=True)).sum(1) > 1).sum())
        hits.append(np.argmax(m, 1) == y[rows])
    return float(np.concatenate(hits).mean()), tied


def dequantized_model(prog: mexc.Program, dtype: torch.dtype) -> FashionCNN:
    """A FashionCNN holding the program's dequantized state (weights and BN running stats)."""
    model = FashionCNN().to(dtype)
    sd = model.state_dict()
    for k in sd:
        if k in prog.state:
            sd[k] = torch.from_numpy(prog.state[k].dequantize()).to(dtype)
    model.load_state_dict(sd)
    return model


def float_accuracy(prog: mexc.Program, x: np.ndarray, y: np.ndarray, batch_stats: bool) -> float:
    model = dequantized_model(prog, torch.float32)
    model.train(batch_stats)
    with torch.no_grad():
        pred = np.concatenate(
            [
                model(torch.from_numpy(x[s : s + prog.batch])).argmax(1).numpy()
                for s in range(0, len(x), prog.batch)
            ]
        )
    return float((pred == y).mean())


def simulated_rounding_accuracy(prog: mexc.Program, x: np.ndarray, y: np.ndarray) -> float:
    """PyTorch float64 inference on the dequantized state, rounding (nearest, B bits, one
    exponent per batch, as `quantize`) where the integer path rounds: the input, each conv
    output, x-hat and each BN output; the logits stay float."""
    model = dequantized_model(prog, torch.float64)
    f, bits = model.features, prog.options.bits

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(quantize(t.numpy(), bits).dequantize())

    def forward(h: torch.Tensor) -> torch.Tensor:
        for conv, bn in ((f[0], f[1]), (f[4], f[5])):
            h = rounded(conv(h))
            c = (1, -1, 1, 1)
            xhat = (h - bn.running_mean.view(c)) / torch.sqrt(bn.running_var.view(c) + bn.eps)
            h = rounded(rounded(xhat) * bn.weight.view(c) + bn.bias.view(c))
            h = torch.nn.functional.max_pool2d(torch.relu(h), 2)
        return model.classifier(torch.flatten(h, 1))

    with torch.no_grad():
        pred = np.concatenate(
            [
                forward(rounded(torch.from_numpy(x[s : s + prog.batch]).double())).argmax(1)
                for s in range(0, len(x), prog.batch)
            ]
        )
    return float((pred == y).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=12800)
    ap.add_argument("--test", type=int, default=2560)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--target", default="auto", help="mexc target of the training run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_paths.json"))
    args = ap.parse_args()
    x, y = load_fashion_mnist("train")
    xt, yt = load_fashion_mnist("test")
    x, y, xt, yt = x[: args.train], y[: args.train], xt[: args.test], yt[: args.test]
    torch.manual_seed(0)
    batch = 128
    steps = args.epochs * (len(x) // batch)
    opt = mexc.SGD(0.05, 0.9, 5e-4, mexc.Cosine(steps, steps // 5))
    prog = mexc.compile(
        FashionCNN(), (torch.from_numpy(x[:batch]),), optimizer=opt, target=args.target
    )
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        for idx in batches(len(x), batch, 0, epoch):
            prog.step(x[idx], y[idx])
    eight_bit, tied = eight_bit_logits(prog, xt, yt)
    rows = {
        "integer, BN running statistics": prog.evaluate(xt, yt),
        "integer, 8-bit logits (first index on ties)": eight_bit,
        "integer, BN batch statistics": integer_batch_stats_accuracy(prog, xt, yt),
        "float on integer weights, running statistics": float_accuracy(prog, xt, yt, False),
        "float on integer weights, batch statistics": float_accuracy(prog, xt, yt, True),
        "float, the integer path's roundings simulated": simulated_rounding_accuracy(prog, xt, yt),
    }
    for name, acc in rows.items():
        print(f"{name:<48} {100 * acc:6.2f} %")
    whole = len(yt) - len(yt) % prog.batch
    print(f"test rows whose 8-bit logits tie for the maximum: {tied} of {whole} (whole batches)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "train_seconds": time.perf_counter() - t0,
                "accuracy": rows,
                "tied_rows_8bit": tied,
                "checksum": prog.state_checksum(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
