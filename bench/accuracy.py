"""Accuracy benchmark: integer-only training vs FP32 (issue 4's table), via the trainer API.

    python bench/accuracy.py                                   # the full table (slow)
    python bench/accuracy.py --epochs 1 --limit-train 2048 --configs fashion,digits

Configurations (`--configs` picks a comma-separated subset):

    fashion        FashionCNN, Fashion-MNIST, 5 epochs, batch 128, SGD lr 0.05 momentum 0.9
                   wd 5e-4, cosine with 1 epoch warmup, 8 bits, stochastic rounding; and FP32
    fashion-no-pgv     the same with one velocity exponent per tensor (--no-per-group-velocity)
    fashion-nearest    the same with deterministic (round-to-nearest) rounding
    fashion-bits6      the same at B = 6
    fashion-bits4      the same at B = 4
    fashion-bits6-ch, fashion-bits4-ch, digits-bits6-ch, digits-bits4-ch, resnet-bits6-ch,
    resnet-bits4-ch
                   B = 6 and B = 4 with channel exponents (docs/numerics.md section 5; B = 4 at
                   peak lr 0.02); they run on the reference target (--target reference)
    vit            ViTTiny (examples/vit.py: patch 7, dim 64, 2 blocks, 4 heads, MLP ratio 2),
                   Fashion-MNIST with the fashion recipe; and FP32
    digits         DigitsCNN, scikit-learn digits, 10 epochs, batch 32; and FP32
    fashion-mnv3   torchvision mobilenet_v3_small(width_mult=0.5), built unchanged, on
                   Fashion-MNIST padded to 32 x 32 and replicated to 3 channels, the fashion
                   recipe; and FP32
    fashion-timm-vit   timm VisionTransformer(img_size 28, patch 7, 1 channel, embed 64, depth
                   2, 4 heads), the fashion recipe; and FP32
    mnv2, resnet   MobileNetV2Tiny / SmallResNet (examples/models.py), the fashion recipe; and FP32
    vit-no-pgv, mnv2-no-pgv, resnet-no-pgv
                   the per-group velocity ablation of vit, mnv2 and resnet
    digits-bits6, digits-bits4, resnet-bits6, resnet-bits4
                   digits and resnet at B = 6 and B = 4
    vit-adamw, fashion-adamw
                   ViTTiny / FashionCNN with integer AdamW (lr 1e-3, betas (0.9, 0.999), eps
                   1e-8, decoupled weight decay 0.01), the fashion recipe otherwise; and FP32
                   AdamW (torch.optim.AdamW) with the same hyperparameters

The FP32 run of `fashion` is the reference of every fashion-* row, and likewise `vit`, `mnv2`,
`resnet` and `digits` of their variants (the FP32 baseline does not depend on bits, rounding or
velocity grouping; a variant's gap is printed when its reference runs in the same command).
Results go to bench/results/accuracy.json (`--out`) with the command, date and machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.models import DigitsCNN, FashionCNN, MobileNetV2Tiny, SmallResNet  # noqa: E402
from examples.vit import ViTTiny  # noqa: E402
from mexc.data import load_splits  # noqa: E402
from mexc.trainer import provenance, run_training, write_json_atomic  # noqa: E402

FASHION: dict[str, Any] = dict(
    model="FashionCNN", data="fashion-mnist", epochs=5, batch=128, bits=8,
    rounding="auto", per_group_velocity=True, fp32=False, ref="fashion", channels=False,
)  # fmt: skip
DIGITS: dict[str, Any] = dict(
    model="DigitsCNN", data="digits", epochs=10, batch=32, bits=8, rounding="auto",
    per_group_velocity=True, fp32=True, ref=None, channels=False,
)  # fmt: skip
ADAMW: dict[str, Any] = dict(optimizer="adamw", lr=1e-3, weight_decay=0.01)
CONFIGS: dict[str, dict[str, Any]] = {
    "fashion": {**FASHION, "fp32": True, "ref": None},
    "fashion-no-pgv": {**FASHION, "per_group_velocity": False},
    "fashion-nearest": {**FASHION, "rounding": "nearest"},
    "fashion-bits6": {**FASHION, "bits": 6},
    "fashion-bits4": {**FASHION, "bits": 4},
    # channel exponents (docs/numerics.md section 5), reference target; B = 4 at lr 0.02
    "fashion-bits6-ch": {**FASHION, "bits": 6, "channels": True},
    "fashion-bits4-ch": {**FASHION, "bits": 4, "channels": True, "lr": 0.02},
    "vit": {**FASHION, "model": "ViTTiny", "fp32": True, "ref": None},
    "digits": DIGITS,
    "fashion-mnv3": {**FASHION, "model": "mobilenet_v3_small", "fp32": True, "ref": None,
                     "transform": "rgb32"},
    "fashion-timm-vit": {**FASHION, "model": "timm_vit", "fp32": True, "ref": None},
    # the per-group velocity ablation on the models where the paper finds it matters
    "vit-no-pgv": {**FASHION, "model": "ViTTiny", "per_group_velocity": False, "ref": "vit"},
    "mnv2": {**FASHION, "model": "MobileNetV2Tiny", "fp32": True, "ref": None},
    "mnv2-no-pgv": {**FASHION, "model": "MobileNetV2Tiny", "per_group_velocity": False,
                    "ref": "mnv2"},
    "resnet": {**FASHION, "model": "SmallResNet", "fp32": True, "ref": None},
    "resnet-no-pgv": {**FASHION, "model": "SmallResNet", "per_group_velocity": False,
                      "ref": "resnet"},
    # low bit widths on a second dataset and model
    "digits-bits6": {**DIGITS, "bits": 6, "fp32": False, "ref": "digits"},
    "digits-bits4": {**DIGITS, "bits": 4, "fp32": False, "ref": "digits"},
    "resnet-bits6": {**FASHION, "model": "SmallResNet", "bits": 6, "ref": "resnet"},
    "resnet-bits4": {**FASHION, "model": "SmallResNet", "bits": 4, "ref": "resnet"},
    "digits-bits6-ch": {**DIGITS, "bits": 6, "fp32": False, "ref": "digits", "channels": True},
    "digits-bits4-ch": {**DIGITS, "bits": 4, "fp32": False, "ref": "digits", "channels": True,
                        "lr": 0.02},
    "resnet-bits6-ch": {**FASHION, "model": "SmallResNet", "bits": 6, "ref": "resnet",
                        "channels": True},
    "resnet-bits4-ch": {**FASHION, "model": "SmallResNet", "bits": 4, "ref": "resnet",
                        "channels": True, "lr": 0.02},
    # integer AdamW against FP32 AdamW (docs/numerics.md section 12b)
    "vit-adamw": {**FASHION, **ADAMW, "model": "ViTTiny", "fp32": True, "ref": None},
    "fashion-adamw": {**FASHION, **ADAMW, "fp32": True, "ref": None},
}  # fmt: skip


def _mobilenet_v3_small() -> torch.nn.Module:
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(width_mult=0.5, num_classes=10)


def _timm_vit() -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4
    )


MODELS = {
    "FashionCNN": FashionCNN,
    "DigitsCNN": DigitsCNN,
    "ViTTiny": ViTTiny,
    "MobileNetV2Tiny": MobileNetV2Tiny,
    "SmallResNet": SmallResNet,
    "mobilenet_v3_small": _mobilenet_v3_small,
    "timm_vit": _timm_vit,
}


def _rgb32(x: np.ndarray) -> np.ndarray:
    """[N, 1, 28, 28] -> [N, 3, 32, 32]: zero padding of 2, the channel replicated."""
    padded = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))
    return np.ascontiguousarray(np.repeat(padded, 3, axis=1))


def run_config(name: str, cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    train, test = load_splits(cfg["data"], args.limit_train, args.limit_test)
    if cfg.get("transform") == "rgb32":
        train, test = (_rgb32(train[0]), train[1]), (_rgb32(test[0]), test[1])
    torch.manual_seed(args.seed)
    model = MODELS[cfg["model"]]()
    print(f"== {name}: {cfg['model']} on {cfg['data']} ({len(train[1])} train images)", flush=True)
    return run_training(
        model,
        train,
        test,
        model_name=cfg["model"],
        dataset=cfg["data"],
        epochs=args.epochs or cfg["epochs"],
        batch=cfg["batch"],
        lr=args.lr if args.lr is not None else cfg.get("lr", 0.05),
        momentum=0.9,
        weight_decay=cfg.get("weight_decay", 5e-4),
        optimizer=cfg.get("optimizer", "sgd"),
        schedule="cosine",
        warmup=None,
        bits=cfg["bits"],
        rounding=args.rounding or cfg["rounding"],
        per_group_velocity=cfg["per_group_velocity"],
        channel_exponents=cfg["channels"],
        seed=args.seed,
        target=args.target,
        compare_fp32=cfg["fp32"] and not args.no_fp32,
        progress=not args.quiet,
        command=sys.argv,
    )


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("config", "optimizer", "bits", "rounding", "pgv", "epochs", "int %", "fp32 %",
            "gap pts", "mem int/fp32", "state B/param", "int s", "img/s")  # fmt: skip
    lines = [head]
    for r in rows:
        res, c = r["results"], r["results"]["config"]
        fp = r["fp32_accuracy"]
        gap = None if fp is None else 100 * (fp - res["integer"]["accuracy"])
        pgv = "on" if c["per_group_velocity"] else "off"
        mem = res["memory"]
        per_param = mem.get("param_state_bytes", 0) / max(mem.get("params", 0), 1)
        lines.append(
            (
                r["name"],
                c.get("optimizer", "SGD"),
                str(c["bits"]),
                c["rounding"],
                pgv,
                str(c["epochs"]),
                _pct(res["integer"]["accuracy"]),
                _pct(fp),
                "-" if gap is None else f"{gap:+.2f}",
                f"{mem['formula_ratio']:.3f}",
                f"{per_param:.2f}",
                f"{res['integer']['seconds']:.0f}",
                f"{res['integer']['images_per_s']:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out) + "\n"


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    """Write the rows so far to args.out (atomically) and return their table."""
    text = table(rows)
    doc = {
        **provenance("mexc-bench-accuracy-1", ["python", *sys.argv]),
        "limits": {
            "epochs": args.epochs,
            "limit_train": args.limit_train,
            "limit_test": args.limit_test,
        },  # fmt: skip
        "table": text,
        "rows": rows,
    }
    write_json_atomic(args.out, doc)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    ap.add_argument("--epochs", type=int, default=None, help="override every config's epochs")
    ap.add_argument("--limit-train", type=int, default=None, help="first N training images")
    ap.add_argument("--limit-test", type=int, default=None, help="first N test images")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate of every run (default: each config's; SGD 0.05, AdamW 1e-3)",
    )
    ap.add_argument(
        "--rounding",
        default=None,
        help="rounding mode of every integer run (default: each config's; see mexc.compile)",
    )
    ap.add_argument("--target", default="auto", help="mexc target of the integer runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "accuracy.json"))
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument(
        "--no-fp32", action="store_true", help="integer runs only (an ablation's second seed)"
    )
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    rows: list[dict[str, Any]] = []
    fp32_of: dict[str, float | None] = {}
    text = table(rows)
    for name in names:
        cfg = CONFIGS[name]
        res = run_config(name, cfg, args)
        fp = res["fp32"]["accuracy"] if res["fp32"] else None
        fp32_of[name] = fp
        if fp is None and cfg["ref"] is not None:
            fp = fp32_of.get(cfg["ref"])
        rows.append({"name": name, "fp32_accuracy": fp, "results": res})
        # written after every config, so a stopped multi-config run keeps what it finished
        text = _write(args, rows)
    print(text, end="")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
