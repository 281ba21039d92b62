"""Build the artifacts that bench/gpu_check.sh runs on a GPU machine (which has no TVM or nvcc).

    python bench/make_gpu_artifacts.py [--archs sm_80,sm_90] [--out build/gpu] [--steps 3]

- fashion (FashionCNN, batch 128) and resnet18 (ResNet-18, batch 16): the CUDA artifact of the
  whole training step, a batch (check.npz) and expected.json: the loss and state checksum after
  each of `--steps` steps and the SHA-256 of every plan buffer after the first step, computed
  here by the host twin (the same plan's TIR through TVM's llvm target, bit-exact with the
  reference executor: tests/codegen/test_cuda_step.py);
- resnet18-b128 (batch 128): the artifact the GPU times against PyTorch FP32 and BF16;
- with --only, also vit (ViTTiny, batch 64) and mobilenet (MobileNetV2Tiny, batch 128), both
  checked and timed, resnet18-b128-p256 and -p32 (timed, a 256 or 32 MiB pack budget: fewer
  launches, more bytes), smallresnet-b4 (B = 4: channel exponents) and smallresnet-adamw
  (integer AdamW), both checked;
- and beside the folder (`<out>-dp`, unless --no-dp): a data-parallel worker's artifact with its
  collectives (bench/gpu_dp_check.py --prepare), which gpu_check.sh runs as 2 workers.

--emulate runs the first step of each checked artifact here through the CPU emulator of its own
CUDA source (mexc.backends.cuda.emulator) and fails unless its state checksum and every plan
buffer equal the host twin's: the artifact carried to the GPU has then already run once, kernel
by kernel.
Minutes per artifact (the Fashion CNN at batch 128 is the slow one).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from mexc.backends.cuda.build import build_step  # noqa: E402
from mexc.backends.llvm.step import LlvmProgram  # noqa: E402

# name: (model "module:Class", input shape, batch, check exactness, time it, pack budget or
# None for the GPU plan's default, compile options: bits, optimizer "adamw")
Target = tuple[str, tuple[int, ...], int, bool, bool, int | None, dict[str, Any]]
TARGETS: dict[str, Target] = {
    "fashion": ("examples.models:FashionCNN", (1, 28, 28), 128, True, False, None, {}),
    "resnet18": ("examples.resnet:ResNet18", (3, 32, 32), 16, True, False, None, {}),
    "resnet18-b128": ("examples.resnet:ResNet18", (3, 32, 32), 128, False, True, None, {}),
    "vit": ("examples.vit:ViTTiny", (1, 28, 28), 64, True, True, None, {}),
    # the launch count against the bytes: 256 MiB of packs instead of 4 (docs/cuda.md)
    "resnet18-b128-p256": (
        "examples.resnet:ResNet18", (3, 32, 32), 128, False, True, 1 << 28, {}
    ),
    "resnet18-b128-p32": (
        "examples.resnet:ResNet18", (3, 32, 32), 128, False, True, 1 << 25, {}
    ),
    "mobilenet": ("examples.models:MobileNetV2Tiny", (1, 28, 28), 128, True, True, None, {}),
    # channel exponents (on by default below 8 bits) and integer AdamW
    "smallresnet-b4": ("examples.models:SmallResNet", (1, 28, 28), 32, True, False, None,
                       {"bits": 4}),
    "smallresnet-adamw": ("examples.models:SmallResNet", (1, 28, 28), 32, True, False, None,
                          {"optimizer": "adamw"}),
}  # fmt: skip
DEFAULT = "fashion,resnet18,resnet18-b128"


def _program(
    model: str, shape: tuple[int, ...], batch: int, options: dict[str, Any] | None = None
) -> mexc.Program:
    module, name = model.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    torch.manual_seed(0)
    options = dict(options or {})
    opt: Any = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(100, 5))
    if options.pop("optimizer", None) == "adamw":
        opt = mexc.AdamW(lr=1e-3, weight_decay=0.05, schedule=mexc.Cosine(100, 5))
    return mexc.compile(cls(), (torch.zeros(batch, *shape),), optimizer=opt, **options)


def check_batch(prog: mexc.Program, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """The fixed batch a check trains on (seed 0), also written to <folder>/check.npz."""
    rng = np.random.default_rng(0)
    x, y = prog.random_batch(rng)
    np.savez(folder / "check.npz", x=x, y=y)
    return x, y


def _expected(prog: mexc.Program, folder: Path, steps: int, budget: int | None) -> dict:
    """Run the host twin on a fixed batch; what the GPU must reproduce."""
    x, y = check_batch(prog, folder)
    # every buffer digested; the artifact's plan, its pack budget too
    twin = LlvmProgram(prog, plan_device="gpu", layout="separate", pack_budget=budget)
    losses, checksums, buffers = [], [], {}
    for step in range(steps):
        losses.append(twin.step(x, y))
        checksums.append(twin.state_checksum())
        if step == 0:
            buffers = twin.buffer_digests()
    # the artifact's inference plan, after the steps (CudaProgram.predict)
    predicted = twin.predict(x).tolist()
    return {"losses": losses, "checksums": checksums, "buffers": buffers, "predictions": predicted}


def _emulate_first_step(folder: Path, doc: dict) -> dict:
    """One step of the artifact through the CPU emulator, compared with the twin's results."""
    from mexc.backends.cuda.emulator import load_emulated

    emu = load_emulated(folder, layout="separate")  # buffer by buffer, as the twin
    batch = np.load(folder / "check.npz")
    t0 = time.perf_counter()
    loss = emu.step(batch["x"], batch["y"])
    seconds = round(time.perf_counter() - t0, 1)
    digests = emu.buffer_digests()
    wrong = [name for name, sha in doc["buffers"].items() if digests.get(name) != sha]
    exact = loss == doc["losses"][0] and emu.state_checksum() == doc["checksums"][0] and not wrong
    return {"exact": exact, "seconds": seconds, "buffers_differing": wrong[:10]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="sm_80,sm_90")
    ap.add_argument("--out", default=str(ROOT / "build" / "gpu"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default=DEFAULT, help=f"comma-separated of {list(TARGETS)}")
    ap.add_argument("--emulate", action="store_true", help="run step 1 on the CPU emulator")
    ap.add_argument("--no-dp", action="store_true", help="skip the data-parallel artifact")
    args = ap.parse_args(argv)
    archs = tuple(args.archs.split(","))
    failed = False
    for name in args.only.split(","):
        model, shape, batch, exact, timed, budget, options = TARGETS[name]
        t0 = time.perf_counter()
        prog = _program(model, shape, batch, options)
        folder = Path(args.out) / name
        man = build_step(prog, archs, folder, pack_budget=budget, eval_plan=exact)
        doc: dict = {"model": model, "batch": batch}
        if exact:
            twin = _program(model, shape, batch, options)
            doc.update(_expected(twin, folder, args.steps, budget))
            if args.emulate:
                doc["emulated"] = _emulate_first_step(folder, doc)
                failed |= not doc["emulated"]["exact"]
                print(f"{folder}: emulated step 1 on the CPU: {doc['emulated']}")
        if timed:
            doc["timing"] = {
                "model": model,
                "input_shape": list(shape),
                "batch": batch,
                "vocab": prog.vocab,
                "label_shape": list(prog.label_shape),
                "classes": prog.num_classes,
            }
        (folder / "expected.json").write_text(json.dumps(doc, indent=1))
        print(
            f"{folder}: {len(man['kernels'])} kernels per step, built in "
            f"{time.perf_counter() - t0:.1f} s (TVM {man['seconds']['tvm']} s, "
            f"nvcc {man['seconds']['nvcc']} s)"
        )
    if not args.no_dp:
        import gpu_dp_check

        folder = Path(f"{Path(args.out)}-dp")
        gpu_dp_check.prepare(folder, archs)
        if args.emulate:
            failed |= gpu_dp_check.check(folder, emulate=True) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
