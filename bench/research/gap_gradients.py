"""Gradient agreement with FP32 at the same weights: integer program vs simulated INT8 rounding.

    python bench/research/gap_gradients.py [--epochs 3] [--batches 10] [--patch x16]

Trains the Fashion CNN in FP32 for a few epochs (SGD lr 0.02, momentum 0.9, wd 5e-4), loads the
weights into a compiled integer program (INT8, one exponent per tensor), and for `--batches`
training batches compares per-parameter gradients with PyTorch float64 autograd on the same
dequantized weights and quantized input: the integer program's (`int`), and those of the float
model with simulated 8-bit stochastic rounding of every conv / BN / linear output in the forward
pass and of the gradients arriving there in the backward pass (`sim`). Prints the mean cosine per
parameter; writes bench/results/gap_gradients.json. `--patch` applies one of
bench/research/gap_leads.py's reference-kernel patches first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from bench.research.gap_leads import PATCHES  # noqa: E402
from bench.research.gap_sim import Rounder, hook_activations  # noqa: E402
from examples.models import FashionCNN  # noqa: E402
from mexc.data import batches, load_splits  # noqa: E402
from mexc.kernels import quantize  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402
from tests.compiler.helpers import (  # noqa: E402
    cosine,
    dequantized_copy,
    float_gradients,
    integer_gradients,
)


def pretrain(epochs: int, train: Any) -> nn.Module:
    torch.manual_seed(0)
    model = FashionCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    for epoch in range(epochs):
        for idx in batches(len(train[1]), 128, 0, epoch):
            opt.zero_grad()
            x, y = torch.from_numpy(train[0][idx]), torch.from_numpy(train[1][idx])
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def trained_program(epochs: int, train: Any) -> tuple[nn.Module, mexc.Program]:
    """The Fashion CNN after `epochs` of FP32 training, and a compiled program whose state holds
    those weights as INT8 (one exponent per tensor)."""
    model = pretrain(epochs, train)
    prog = mexc.compile(model, (torch.zeros(128, 1, 28, 28),), seed=0)
    prog.state = dict(prog.state) | {
        n: quantize(p.detach().double().numpy(), 8) for n, p in model.named_parameters()
    }
    return model, prog


def experiment_args(doc: str, batches: int, out: str | None) -> argparse.ArgumentParser:
    """The options these gap experiments share: --epochs, --batches, --patch, --out."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=batches)
    ap.add_argument("--patch", choices=sorted(PATCHES), default=None)
    ap.add_argument("--out", default=out)
    return ap


def patched_setup(args: argparse.Namespace) -> tuple[Any, nn.Module, mexc.Program]:
    """Apply `--patch`, then (train split, FP32 model, integer program) after `--epochs`."""
    if args.patch:
        PATCHES[args.patch]()
    torch.set_num_threads(1)
    train, _ = load_splits("fashion-mnist", None, None)
    return (train, *trained_program(args.epochs, train))


def main(argv: list[str] | None = None) -> int:
    default_out = str(ROOT / "bench" / "results" / "gap_gradients.json")
    args = experiment_args(__doc__, 10, default_out).parse_args(argv)
    train, model, prog = patched_setup(args)
    sim = dequantized_copy(model, prog)
    hook_activations(sim, Rounder(5), True, True)
    cos: dict[str, dict[str, list[float]]] = {"int": {}, "sim": {}}
    for i, idx in enumerate(batches(len(train[1]), 128, 0, args.epochs + 4)):
        if i >= args.batches:
            break
        x, y = train[0][idx], train[1][idx]
        ref = float_gradients(model, prog, x, y)
        got = {"int": integer_gradients(prog, x, y)}
        sim.zero_grad()
        xq = torch.from_numpy(quantize(x.astype(np.float64), 8).dequantize())
        nn.functional.cross_entropy(sim(xq), torch.from_numpy(y)).backward()
        got["sim"] = {n: p.grad.numpy() for n, p in sim.named_parameters() if p.grad is not None}
        for kind, grads in got.items():
            for name, g in grads.items():
                cos[kind].setdefault(name, []).append(cosine(g, ref[name]))
    rows = [
        {
            "param": n,
            "int": round(float(np.mean(v)), 3),
            "sim": round(float(np.mean(cos["sim"][n])), 3),
        }
        for n, v in cos["int"].items()
    ]
    print(f"{'parameter':22s} {'int':>6s} {'sim':>6s}")
    for r in rows:
        print(f"{r['param']:22s} {r['int']:6.3f} {r['sim']:6.3f}")
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-gap-gradients-1", ["python", *sys.argv]),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
