"""How long building a step's launch plan takes (`step_plan.build_plan`, its searches included).

Each spec is MODEL:BATCH:DEVICE (an example model, ResNet18, or ViTTiny; device cpu or gpu).
Imports and TVM's one-time setup are warmed by a small build first, so the figure is the
plan's own time; it does not depend on the kernel cache (no kernel is compiled).

    python bench/plan_time.py FashionCNN:128:cpu SmallResNet:128:cpu \\
        MobileNetV2Tiny:128:cpu ResNet18:128:gpu
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.resnet import ResNet18  # noqa: E402
from examples.vit import ViTTiny  # noqa: E402
from mexc.lowering.step_plan import build_plan  # noqa: E402

MODELS = {**EXAMPLES, "ResNet18": (ResNet18, (3, 32, 32)), "ViTTiny": (ViTTiny, (1, 28, 28))}


def plan_seconds(name: str, batch: int, device: str) -> tuple[float, int]:
    """Seconds to build the plan of `name`'s step at `batch` for `device`, and its launches."""
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(batch, *shape),))
    t0 = time.perf_counter()
    plan = build_plan(prog, 8, device)
    return time.perf_counter() - t0, len(plan.launches)


def main(specs: list[str]) -> None:
    if not specs:
        raise SystemExit(__doc__)
    plan_seconds("MLP", 2, "cpu")  # warm: imports, TVM's first schedules
    plan_seconds("MLP", 2, "gpu")
    for spec in specs:
        name, batch, device = spec.split(":")
        seconds, launches = plan_seconds(name, int(batch), device)
        print(f"{spec}: build_plan {seconds:.2f} s, {launches} launches", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
