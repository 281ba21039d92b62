"""Compile timm models mexc was not tuned for and report, per model, whether it compiles, its
integer logits' cosine with torch's (float64 on the program's dequantized weights and input, in
eval mode) and two training steps' losses, on the reference target; or the error.

    python bench/research/model_probe.py efficientvim_m1 resnetv2_50d_frn --size 64 --batch 2

One JSON line per model. The cosine means little where torch's own logits are near zero at
random initialization (docs/frontend.md, "Models checked beyond the zoo's twelve").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mexc  # noqa: E402
from tests.compiler.helpers import _as_input, cosine, dequantized_copy  # noqa: E402


def probe(name: str, size: int, batch: int) -> dict[str, Any]:
    import timm

    row: dict[str, Any] = {"model": name}
    try:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
        start = time.perf_counter()
        prog = mexc.compile(model, (torch.from_numpy(x),), target="reference")
        row["compile_s"] = round(time.perf_counter() - start, 1)
        want = dequantized_copy(model, prog).eval()(_as_input(prog, x)).detach().numpy()
        got = prog.logits(x)
        row["cos"] = round(cosine(got, want), 4)
        row["torch_max_logit"] = float(np.abs(want).max())
        y = rng.integers(0, 10, batch)
        row["losses"] = [round(prog.step(x, y), 4) for _ in range(2)]
    except Exception as err:  # noqa: BLE001 - a probe reports every failure and goes on
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    for name in args.models:
        print(json.dumps(probe(name, args.size, args.batch)), flush=True)


if __name__ == "__main__":
    main()
