"""Integer forward/backward with a float optimizer: is the accuracy gap made by the update?

    python bench/research/gap_hybrid.py   # Fashion CNN, the recipe of bench/accuracy.py, 5 epochs

Each step runs the compiled integer program (reference executor, the same rounding keys as a real
run) with the integer update switched off (learning rate 0), reads the integer weight gradients,
and applies PyTorch-style SGD with momentum and weight decay to float64 master weights, which are
quantized to INT8 (one exponent per tensor, round to nearest) for the next step. BN running
statistics keep their integer update. If this run matched FP32, the integer optimizer would be the
cause of the gap; if it matches the integer run, the gap is made in the forward/backward pass.
Writes bench/results/gap_hybrid.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import FashionCNN  # noqa: E402
from mexc.backends.reference.interp import StepEnv, execute  # noqa: E402
from mexc.data import batches, load_splits  # noqa: E402
from mexc.ir import Op  # noqa: E402
from mexc.kernels import quantize  # noqa: E402
from mexc.mx import Acc, RoundCtx  # noqa: E402
from mexc.numerics import FixedScalar, expand_exponent  # noqa: E402
from mexc.trainer import make_optimizer, provenance, write_json_atomic  # noqa: E402

EPOCHS, BATCH, LR, MOMENTUM, WD = 5, 128, 0.05, 0.9, 5e-4


def dequantize_acc(acc: Acc) -> np.ndarray:
    scale = np.exp2(expand_exponent(acc.e, np.ndim(acc.a)).astype(np.float64))
    return np.asarray(acc.a, np.float64) * scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gap_hybrid.json"))
    args = ap.parse_args(argv)
    train, test = load_splits("fashion-mnist", None, None)
    torch.manual_seed(args.seed)
    model = FashionCNN()
    opt = make_optimizer(LR, MOMENTUM, WD, "cosine", len(train[1]) // BATCH, EPOCHS, None)
    prog = mexc.compile(model, (torch.zeros(BATCH, 1, 28, 28),), optimizer=opt, seed=args.seed)
    master = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    velocity = {n: np.zeros_like(w) for n, w in master.items()}
    updates = list(prog.graph.nodes_of(Op.SGD_UPDATE))
    zero = FixedScalar(0, 0)
    history, step = [], 0
    for epoch in range(EPOCHS):
        losses = []
        for idx in batches(len(train[1]), BATCH, args.seed, epoch):
            state = dict(prog.state) | {n: quantize(w, 8) for n, w in master.items()}
            ctx = RoundCtx("stochastic", args.seed, step, 8)
            x, y = train[0][idx].astype(np.float64), train[1][idx].astype(np.int64)
            values = execute(
                list(prog.graph.nodes), StepEnv(ctx, True, x, y, state, zero, zero, zero, BATCH)
            )
            for name, v in prog.graph.outputs:
                if name.startswith("state:"):
                    state[name[6:]] = values[v]
            prog.state = state
            lr = opt.lr * opt.schedule.factor(step)
            for u in updates:
                name = str(u.attrs.param)
                grad = dequantize_acc(values[u.inputs[1]]).reshape(master[name].shape)
                velocity[name] = MOMENTUM * velocity[name] + grad + WD * master[name]
                master[name] = master[name] - lr * velocity[name]
            losses.append(float(values[prog.graph.output("loss")]))
            step += 1
        prog.state = dict(prog.state) | {n: quantize(w, 8) for n, w in master.items()}
        record = {"epoch": epoch + 1, "train_loss": float(np.mean(losses))}
        record["test_accuracy"] = prog.evaluate(test[0], test[1])
        history.append(record)
        print(record, flush=True)
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-gap-hybrid-1", ["python", *sys.argv]),
            "seed": args.seed,
            "history": history,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
