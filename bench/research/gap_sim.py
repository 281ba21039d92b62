"""Where does the integer-vs-FP32 accuracy gap come from? FP32 training with simulated INT8 parts.

    # Fashion CNN, 5 epochs per mode; the second line rounds to 4 bits with an 8-bit velocity
    python bench/research/gap_sim.py --modes fp32,w,wc,wv,wvg,wvga,wvgab,s
    python bench/research/gap_sim.py --bits 4 --velocity-bits 8 --modes wv,wva
    python bench/research/gap_sim.py --bits 4 --velocity-bits 8 --act-exp channel --modes wvgab

Each mode trains the Fashion CNN in PyTorch with the recipe of bench/accuracy.py (SGD lr 0.05,
momentum 0.9, wd 5e-4, cosine with 1 epoch warmup, batch 128, same init and data order) and
rounds chosen tensors to B-bit mantissas with power-of-two exponents and stochastic rounding,
as the integer program stores them. Mode letters:

    w  weights after every update, one exponent per tensor
    c  (with w) one exponent per output channel instead
    v  momentum buffers after every update, one exponent per output channel (per-group velocity)
    g  weight gradients before the update, one exponent per output channel
    a  forward outputs of every conv / BN / linear (training only), exponents by --act-exp
    b  gradients arriving at those outputs in the backward pass, exponents by --act-exp
    s  softmax probabilities in the loss gradient at 1/256 resolution, capped at 255/256
    l  (with a or b) leave the last layer's output, the logits, unrounded
    n  (with a) round the forward activations to nearest instead of stochastically
    i  the input images (train and test) quantized as the integer program's boundary does
       (kernels.quantize: 8-bit mantissas, one power-of-two exponent; for normalized Fashion-MNIST
       every batch has the same exponent as the whole set, so the set is quantized once)
    fp32  nothing rounded

A mode that matches FP32 rules that part out as the cause of the gap. Results (per-epoch loss and
test accuracy) go to bench/results/gap_sim.json.
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

from examples.models import FashionCNN  # noqa: E402
from mexc.data import batches, load_splits  # noqa: E402
from mexc.fp32 import evaluate  # noqa: E402
from mexc.kernels import quantize  # noqa: E402
from mexc.trainer import make_optimizer, provenance, write_json_atomic  # noqa: E402

EPOCHS, BATCH = 5, 128
ACT_LAYERS = ("Conv2d", "BatchNorm2d", "Linear")  # the layers whose outputs a and b round


class Rounder:
    """Stochastic rounding to B-bit mantissas with power-of-two exponents (seeded)."""

    def __init__(self, seed: int, bits: int = 8, spread: int | None = None) -> None:
        self.gen = torch.Generator().manual_seed(1234 + seed)
        self.q = float(2 ** (bits - 1) - 1)
        self.spread = spread  # most octaves a group's exponent may lie below its tensor's

    def __call__(
        self, w: torch.Tensor, per_channel: bool, axis: int = 0, nearest: bool = False
    ) -> torch.Tensor:
        if per_channel and w.dim() >= 2:
            shape = [1] * w.dim()
            shape[axis] = -1
            m = w.abs().transpose(0, axis).flatten(1).amax(1).clamp_min(1e-30).view(shape)
        else:
            m = w.abs().max().clamp_min(1e-30)
        scale = torch.pow(2.0, torch.ceil(torch.log2(m / self.q)))
        if self.spread is not None and scale.dim():
            scale = torch.clamp_min(scale, scale.max() / 2.0**self.spread)
        u = torch.full_like(w, 0.5) if nearest else torch.rand(w.shape, generator=self.gen)
        return torch.clamp(torch.floor(w / scale + u), -self.q, self.q) * scale


def coarse_softmax_loss() -> Any:
    class CoarseSoftmaxCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            p = torch.softmax(logits, 1)
            ctx.save_for_backward(p, y)
            return -torch.log(p[torch.arange(len(y)), y]).mean()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            p, y = ctx.saved_tensors
            t = torch.clamp(torch.round(p * 256), max=255) / 256
            t[torch.arange(len(y)), y] -= 1
            return grad * t / len(y), None

    return CoarseSoftmaxCE.apply


def hook_activations(
    model: nn.Module,
    rnd: Rounder,
    fwd: bool,
    bwd: bool,
    act_exp: str,
    logits: bool,
    nearest: bool,
    kinds: tuple[str, ...] = ACT_LAYERS,
) -> None:
    grouped, axis = act_exp != "tensor", 1 if act_exp == "channel" else 0

    class RoundAct(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return rnd(x, grouped, axis, nearest) if fwd else x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return rnd(g, grouped, axis) if bwd else g

    layers = [m for m in model.modules() if type(m).__name__ in ACT_LAYERS]
    for m in layers if logits else layers[:-1]:
        if type(m).__name__ not in kinds:
            continue
        m.register_forward_hook(lambda mod, i, o: RoundAct.apply(o) if mod.training else o)


def run_mode(
    mode: str,
    seed: int,
    train: Any,
    test: Any,
    bits: int = 8,
    velocity_bits: int = 8,
    act_exp: str = "tensor",
    lr: float = 0.05,
    kinds: tuple[str, ...] = ACT_LAYERS,
    spread: int | None = None,
) -> list[dict[str, float]]:
    flags = "" if mode == "fp32" else mode
    torch.manual_seed(seed)
    model = FashionCNN()
    rnd = Rounder(seed, bits, spread)
    rnd_v = rnd if velocity_bits == bits and spread is None else Rounder(seed + 1, velocity_bits)
    sched = make_optimizer(lr, 0.9, 5e-4, "cosine", len(train[1]) // BATCH, EPOCHS, None)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = coarse_softmax_loss() if "s" in flags else nn.CrossEntropyLoss()
    if "a" in flags or "b" in flags:
        hook_activations(
            model, rnd, "a" in flags, "b" in flags, act_exp, "l" not in flags, "n" in flags, kinds
        )
    params = list(model.parameters())

    @torch.no_grad()
    def round_params() -> None:
        for p in params:
            p.copy_(rnd(p, "c" in flags))

    if "w" in flags:
        round_params()
    history, step = [], 0
    x_all, y_all = train
    for epoch in range(EPOCHS):
        model.train()
        losses = []
        for idx in batches(len(y_all), BATCH, seed, epoch):
            for group in opt.param_groups:
                group["lr"] = sched.lr * sched.schedule.factor(step)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(torch.from_numpy(x_all[idx])), torch.from_numpy(y_all[idx]))
            loss.backward()
            if "g" in flags:
                with torch.no_grad():
                    for p in params:
                        assert p.grad is not None
                        p.grad.copy_(rnd(p.grad, True))
            opt.step()
            losses.append(float(loss.item()))
            step += 1
            if "w" in flags:
                round_params()
            if "v" in flags:
                with torch.no_grad():
                    for p in params:
                        buf = opt.state[p]["momentum_buffer"]
                        buf.copy_(rnd_v(buf, True))
        record = {"epoch": epoch + 1, "train_loss": float(np.mean(losses))}
        record["test_accuracy"] = evaluate(model, test)
        history.append(record)
        print(mode, record, flush=True)
    return history


def quantized(split: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The images as the integer program sees them after its boundary quantization."""
    return quantize(split[0].astype(np.float64), 8).dequantize().astype(np.float32), split[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="fp32,w,wc,wv,wvg,wvga,wvgab,s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05, help="peak learning rate")
    ap.add_argument("--bits", type=int, default=8, help="mantissa bits of w, g, a, b")
    ap.add_argument("--velocity-bits", type=int, default=None, help="of v (default: --bits)")
    ap.add_argument(
        "--act-exp",
        choices=("tensor", "channel", "sample"),
        default="tensor",
        help="exponent groups of a and b: one per tensor, per channel (axis 1) or per sample",
    )
    ap.add_argument(
        "--act-layers",
        default=",".join(ACT_LAYERS),
        help="module classes whose outputs a and b round",
    )
    ap.add_argument(
        "--spread",
        type=int,
        default=None,
        help="most octaves a channel's exponent of w, g, a, b may lie below its tensor's "
        "(8 - B: the channels share the tensor's int8 container; default unlimited)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gap_sim.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    train, test = load_splits("fashion-mnist", None, None)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m != "fp32" and set(m) - set("wcvgabsiln")]
    if bad:
        ap.error(f"unknown mode letters in {bad}; use fp32 or letters from 'wcvgabsiln'")
    velocity_bits = args.velocity_bits or args.bits
    results = {
        m: run_mode(
            m,
            args.seed,
            *((quantized(train), quantized(test)) if "i" in m else (train, test)),
            bits=args.bits,
            velocity_bits=velocity_bits,
            act_exp=args.act_exp,
            lr=args.lr,
            kinds=tuple(args.act_layers.split(",")),
            spread=args.spread,
        )
        for m in modes
    }
    print(f"{'mode':8s} {'loss':>7s} {'test %':>7s}")
    for m, hist in results.items():
        print(f"{m:8s} {hist[-1]['train_loss']:7.4f} {100 * hist[-1]['test_accuracy']:7.2f}")
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-gap-sim-1", ["python", *sys.argv]),
            "seed": args.seed,
            "bits": args.bits,
            "velocity_bits": velocity_bits,
            "act_exp": args.act_exp,
            "lr": args.lr,
            "act_layers": args.act_layers,
            "spread": args.spread,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
