"""Where along the backward chain the Fashion CNN's integer gradients part from FP32.

    python bench/research/gap_chain.py [--epochs 3] [--batches 6]

After `--epochs` of FP32 training (as bench/research/gap_gradients.py), the integer program's
gradient arriving at each layer output (dlogits, pool 2, BN 2, conv 2, pool 1, BN 1, conv 1) is
compared with PyTorch float64 autograd on the same dequantized weights and quantized input: mean
cosine, fraction of nonzero mantissas, and the share of nonzero mantissas with |m| <= 2. Writes
bench/results/gap_chain.json.
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
from bench.research.gap_gradients import trained_program  # noqa: E402
from mexc.data import batches, load_splits  # noqa: E402
from mexc.ir import Op  # noqa: E402
from mexc.kernels import quantize  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402
from tests.compiler.helpers import cosine, dequantized_copy, step_values  # noqa: E402

# (backward op, its occurrence in graph order) -> the FashionCNN module whose output gradient it is
STAGES = [
    ((Op.SOFTMAX_CE_GRAD, 0), "classifier", "dlogits"),
    ((Op.RESHAPE, -1), "features.7", "into pool 2 output"),
    ((Op.MAXPOOL2D_GRAD, 0), "features.5", "into BN 2 output (after ReLU/pool routing)"),
    ((Op.BATCHNORM_GRAD, 0), "features.4", "BN 2 dx (into conv 2 output)"),
    ((Op.CONV2D_GRAD_INPUT, 0), "features.3", "conv 2 dx (into pool 1 output)"),
    ((Op.MAXPOOL2D_GRAD, 1), "features.1", "into BN 1 output (after ReLU/pool routing)"),
    ((Op.BATCHNORM_GRAD, 1), "features.0", "BN 1 dx (into conv 1 output)"),
]


def backward_node(prog: mexc.Program, op: Op, k: int) -> Any:
    nodes = list(prog.graph.nodes)
    start = next(i for i, n in enumerate(nodes) if n.op is Op.SOFTMAX_CE_GRAD)
    return [n for n in nodes[start:] if n.op is op][k]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gap_chain.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    train, _ = load_splits("fashion-mnist", None, None)
    model, prog = trained_program(args.epochs, train)
    ref = dequantized_copy(model, prog)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(mod: nn.Module, inp: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            outputs[name] = out

        return hook

    modules = dict(ref.named_modules())
    for _, name, _ in STAGES:
        modules[name].register_forward_hook(keep(name))
    stats: dict[str, list[tuple[float, float, float]]] = {}
    for i, idx in enumerate(batches(len(train[1]), 128, 0, args.epochs + 4)):
        if i >= args.batches:
            break
        x, y = train[0][idx], train[1][idx]
        values = step_values(prog, x, y)
        xq = torch.from_numpy(quantize(x.astype(np.float64), 8).dequantize())
        ref.zero_grad()
        nn.functional.cross_entropy(ref(xq), torch.from_numpy(y)).backward()
        for (op, k), name, what in STAGES:
            mx = values[backward_node(prog, op, k).result(0)]
            m = np.asarray(mx.m, np.int64)
            grad = outputs[name].grad
            assert grad is not None
            nz = m != 0
            small = float((nz & (np.abs(m) <= 2)).sum() / max(int(nz.sum()), 1))
            stats.setdefault(what, []).append(
                (cosine(mx.dequantize(), grad.numpy()), float(nz.mean()), small)
            )
    rows = [
        {
            "stage": what,
            "cosine": round(float(np.mean([s[0] for s in v])), 4),
            "nonzero": round(float(np.mean([s[1] for s in v])), 3),
            "small_share": round(float(np.mean([s[2] for s in v])), 3),
        }
        for what, v in stats.items()
    ]
    print(f"{'stage':44s} {'cosine':>7s} {'nonzero':>8s} {'|m|<=2':>7s}")
    for r in rows:
        print(f"{r['stage']:44s} {r['cosine']:7.4f} {r['nonzero']:8.3f} {r['small_share']:7.3f}")
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-gap-chain-1", ["python", *sys.argv]),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
