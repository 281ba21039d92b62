"""Forward-pass error of the integer program and of the rounding simulation, at the same weights.

    python bench/research/gap_forward.py [--epochs 3] [--batches 4] [--patch x16]

After `--epochs` of FP32 training (as bench/research/gap_gradients.py), the Fashion CNN's weights go
into a compiled integer program (INT8, one exponent per tensor). For `--batches` training batches
the output of every layer (conv, BN, ReLU, pool, ..., classifier) is compared with PyTorch float64
on the same dequantized weights and quantized input: relative error ||a - ref|| / ||ref|| of the
integer program's value and of the simulation's (float layers with 8-bit stochastic rounding of
every conv / BN / linear output, bench/research/gap_sim.py). `--patch` applies one of
bench/research/gap_leads.py's reference-kernel patches first. Writes
bench/results/gap_forward[-PATCH].json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.research.gap_gradients import experiment_args, patched_setup  # noqa: E402
from bench.research.gap_sim import Rounder, hook_activations  # noqa: E402
from mexc.data import batches  # noqa: E402
from mexc.ir import Op  # noqa: E402
from mexc.kernels import quantize  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402
from tests.compiler.helpers import dequantized_copy, step_values  # noqa: E402

FORWARD_OPS = {Op.CONV2D_COMPACT, Op.BATCHNORM, Op.RELU, Op.MAXPOOL2D, Op.LINEAR_COMPACT}
# the FashionCNN modules whose outputs those nodes compute, in graph order
MODULES = [f"features.{i}" for i in range(8)] + ["classifier"]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def main(argv: list[str] | None = None) -> int:
    args = experiment_args(__doc__, 4, None).parse_args(argv)
    train, model, prog = patched_setup(args)
    nodes = list(prog.graph.nodes)
    end = next(i for i, n in enumerate(nodes) if n.op is Op.SOFTMAX_CE_GRAD)
    forward = [n for n in nodes[:end] if n.op in FORWARD_OPS]
    assert len(forward) == len(MODULES), [n.op for n in forward]
    ref, sim = dequantized_copy(model, prog), dequantized_copy(model, prog)
    hook_activations(sim, Rounder(5), True, True)
    outs: dict[str, dict[str, torch.Tensor]] = {"ref": {}, "sim": {}}

    def keep(kind: str, name: str) -> Any:
        def hook(mod: nn.Module, inp: Any, out: torch.Tensor) -> None:
            outs[kind][name] = out.detach()

        return hook

    for kind, m in (("ref", ref), ("sim", sim)):
        mods = dict(m.named_modules())
        for name in MODULES:
            mods[name].register_forward_hook(keep(kind, name))
    errs: dict[str, list[tuple[float, float]]] = {}
    for i, idx in enumerate(batches(len(train[1]), 128, 0, args.epochs + 4)):
        if i >= args.batches:
            break
        x, y = train[0][idx], train[1][idx]
        values = step_values(prog, x, y)
        xq = torch.from_numpy(quantize(x.astype(np.float64), 8).dequantize())
        ref(xq)
        sim(xq)
        for node, name in zip(forward, MODULES):
            r = outs["ref"][name].numpy()
            got, simulated = values[node.result(0)].dequantize(), outs["sim"][name].numpy()
            errs.setdefault(name, []).append((rel_err(got, r), rel_err(simulated, r)))
    rows = [
        {
            "module": name,
            "int": round(float(np.mean([e[0] for e in v])), 4),
            "sim": round(float(np.mean([e[1] for e in v])), 4),
        }
        for name, v in errs.items()
    ]
    print(f"{'output of':14s} {'int':>7s} {'sim':>7s}   (relative error to float64)")
    for r in rows:
        print(f"{r['module']:14s} {r['int']:7.4f} {r['sim']:7.4f}")
    tag = f"-{args.patch}" if args.patch else ""
    out = args.out or str(ROOT / "bench" / "results" / f"gap_forward{tag}.json")
    write_json_atomic(
        out, {**provenance("mexc-bench-gap-forward-1", ["python", *sys.argv]), "rows": rows}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
