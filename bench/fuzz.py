"""A fuzz campaign: random models through the compiler and a few training steps each.

    python bench/fuzz.py --seconds 600                  # ten minutes, reference target
    python bench/fuzz.py --models 10000 --seed 1
    python bench/fuzz.py --models 40 --target llvm      # also build and compare llvm per model
    python bench/fuzz.py --seconds 300 --target llvm --every 20

Models come from bench/fuzz_models.py (`WIDE`): convolutional trunks of 1-6 blocks (3x3/5x5/1x1
and grouped convolutions, depthwise, residual blocks, max and average pooling, batch norm, ReLU,
ReLU6, Hardswish, GELU, constant scales), global-average or flatten heads, MLPs with BatchNorm1d,
LayerNorm and dropout, 2-17 classes; batch sizes 2-64, input scales 0 and 1e-4..1e3, B = 4, 6,
8. Each model is compiled for the reference and trained `--steps` steps on one random batch with
the int32 overflow check on, then again with it off (the kernels' fast paths), and with
`--target` on the same model: every run must give the same losses and state checksum.

Counts per outcome (compiled, refused, overflow, nonfinite, bad_state, mismatch, crash; see
bench/fuzz_models.py), the refusal messages and every finding go to bench/results/fuzz.json
(`--out` elsewhere). Exits 1 if anything but `compiled` and `refused` occurred.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.fuzz_models import FAILURES, OUTCOMES, WIDE, Campaign, Case, Outcome, campaign  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, help="stop after this many seconds")
    ap.add_argument("--models", type=int, help="stop after this many models")
    ap.add_argument("--seed", type=int, default=0, help="the campaign's numpy seed")
    ap.add_argument("--steps", type=int, default=3, help="training steps per model")
    ap.add_argument("--target", default="reference", help="also build this target and compare")
    ap.add_argument("--every", type=int, default=1, help="run --target on every N-th model")
    ap.add_argument("--out", default=str(ROOT / "bench/results/fuzz.json"))
    ap.add_argument("--quiet", action="store_true", help="no line per finding")
    args = ap.parse_args(argv)
    if args.seconds is None and args.models is None:
        args.seconds = 60.0
    torch.set_num_threads(1)
    target = None if args.target == "reference" else args.target
    t0 = time.monotonic()

    def progress(i: int, case: Case, out: Outcome) -> None:
        if out.kind not in ("compiled", "refused") and not args.quiet:
            print(f"[{i}] {out.kind}: {out.message} ({out.where}) -- {case.summary()}", flush=True)
        if (i + 1) % 500 == 0:
            rate = (i + 1) / (time.monotonic() - t0)
            print(f"  {i + 1} models, {rate:.1f} models/s", flush=True)

    result = campaign(
        args.seed,
        models=args.models,
        seconds=args.seconds,
        limits=WIDE,
        steps=args.steps,
        target=target,
        every=args.every,
        progress=progress,
    )
    _print_summary(result)
    doc: dict[str, Any] = provenance("mexc-fuzz/1")
    doc.update(
        {
            "seed": args.seed,
            "steps": args.steps,
            "target": args.target,
            "target_every": args.every if target else None,
            "models": result.models,
            "seconds": round(result.seconds, 1),
            "models_per_second": round(result.models / max(result.seconds, 1e-9), 2),
            "counts": result.counts,
            "failures": result.failures,
            "with_batch_norm": result.with_bn,
            "with_channel_exponents": result.with_channels,
            "by_bits": {str(k): v for k, v in sorted(result.by_bits.items())},
            "refusals": dict(sorted(result.refusals.items(), key=lambda kv: -kv[1])),
            "findings": result.findings,
        }
    )
    write_json_atomic(args.out, doc)
    print(f"wrote {args.out}")
    return 1 if result.failures else 0


def _print_summary(r: Campaign) -> None:
    rate = r.models / max(r.seconds, 1e-9)
    print(f"\n{r.models} models in {r.seconds:.0f} s ({rate:.1f} models/s)")
    print(f"{'outcome':<10} {'models':>7}")
    for k in OUTCOMES:
        mark = " <-" if k in FAILURES and r.counts[k] else ""
        print(f"{k:<10} {r.counts[k]:>7}{mark}")
    print(
        f"with batch norm: {r.with_bn}; with channel exponents: {r.with_channels}; "
        f"by B: {dict(sorted(r.by_bits.items()))}"
    )
    for msg, n in sorted(r.refusals.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  refused x{n}: {msg}")


if __name__ == "__main__":
    sys.exit(main())
