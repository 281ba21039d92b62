"""Sparse update: fine-tuning accuracy and training memory when only some parameters train.

    python bench/sparse_update.py                       # the table (about 10 minutes)
    python bench/sparse_update.py --limit-train 4096    # a quick look

The task is a transfer on Fashion-MNIST. The Fashion CNN (examples/models.py) is pretrained in
PyTorch FP32 on the training images of classes 0-4 (SGD lr 0.05, momentum 0.9, `--pretrain-epochs`
epochs). It is then fine-tuned integer-only on the training images of classes 5-9, the fashion
recipe for `--epochs` epochs, once per `trainable` spec (mexc.trainable). It is tested on the test
images of classes 5-9. Each run trains the pretrained FP32 copy beside it with the same
parameters frozen.

Memory per spec:
- the llvm step's allocated bytes at the fine-tuning batch (128);
- the exported C project's static RAM on a Cortex-M4 at batch 4: .data + .bss + the stack
  bound of GCC's -fstack-usage, where arm-none-eabi-gcc is installed, else the C target's
  static arrays (the MCU RAM targets of the MCU issue are for this model at batch 4).

Results go to bench/results/sparse_update.json with the command, date and machine.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import FashionCNN  # noqa: E402
from mexc.data import Arrays, load_splits  # noqa: E402
from mexc.fp32 import train_fp32  # noqa: E402
from mexc.optim import SGD  # noqa: E402
from mexc.trainer import (  # noqa: E402
    provenance,
    run_training,
    trained_params,
    write_json_atomic,
)

SPECS = ("all", "last:1", "last:2", "bias-norm", "last:1,bias-norm")
MCU_BATCH = 4
MCU_CPU = "cortex-m4"


def _classes(data: Arrays, keep: range) -> Arrays:
    x, y = data
    rows = np.isin(y, list(keep))
    return np.ascontiguousarray(x[rows]), np.ascontiguousarray(y[rows])


def mcu_ram(model: torch.nn.Module, trainable: str | None, data: Arrays) -> dict[str, Any]:
    """Static RAM of the exported project at MCU_BATCH: measured on the ELF where the ARM
    toolchain is installed, else the C target's static arrays (what the project declares);
    and the number of parameters it trains."""
    arm = shutil.which("arm-none-eabi-gcc") is not None
    prog = mexc.compile(
        copy.deepcopy(model),
        (torch.zeros(MCU_BATCH, 1, 28, 28),),
        trainable=trainable,
        target="reference" if arm else "c",
    )
    trained = sum(prog.state[k].m.size for k in trained_params(prog))
    if not arm:
        ram = prog.memory_report()["allocated_bytes"]
        return {"how": "c target static arrays", "ram": ram, "trained_params": trained}
    from mexc.backends.c.mcu_sizes import measure

    with tempfile.TemporaryDirectory() as tmp:
        sample = (data[0][: 4 * MCU_BATCH], data[1][: 4 * MCU_BATCH])
        out = mexc.export(prog, Path(tmp) / "p", sample, 4, "mps2-an386")
        subprocess.run(["make", "-s", "-C", str(out), "mcu", f"CPU={MCU_CPU}"], check=True)
        s = measure(out, MCU_CPU)
    return {
        "how": f"{MCU_CPU} ELF",
        "ram": s.ram,
        "data": s.data,
        "bss": s.bss,
        "stack": s.stack,
        "trained_params": trained,
    }


def pretrain(train: Arrays, test: Arrays, epochs: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = FashionCNN()
    opt = SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    hist = train_fp32(model, train, test, opt, 128, seed, epochs)
    print(f"pretrained on classes 0-4: {100 * hist[-1]['test_accuracy']:.2f} %", flush=True)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", default=";".join(SPECS), help="';'-separated trainable specs")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--pretrain-epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--limit-train", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sparse_update.json"))
    args = ap.parse_args(argv)
    train, test = load_splits("fashion-mnist", args.limit_train)
    base = pretrain(_classes(train, range(5)), _classes(test, range(5)), args.pretrain_epochs, 0)
    new_train, new_test = _classes(train, range(5, 10)), _classes(test, range(5, 10))
    rows: list[dict[str, Any]] = []
    for name in [s for s in args.specs.split(";") if s]:
        trainable = None if name == "all" else name
        print(f"== {name}", flush=True)
        res = run_training(
            copy.deepcopy(base),
            new_train,
            new_test,
            model_name="FashionCNN (pretrained on classes 0-4)",
            dataset="fashion-mnist classes 5-9",
            epochs=args.epochs,
            batch=128,
            lr=args.lr,
            seed=args.seed,
            target=args.target,
            compare_fp32=True,
            progress=False,
            trainable=trainable,
            command=["python", *sys.argv],
        )
        mcu = mcu_ram(base, trainable, new_train)
        row = {
            "spec": name,
            "trained_params": mcu["trained_params"],
            "params": res["memory"]["params"],
            "integer_accuracy": res["integer"]["accuracy"],
            "fp32_accuracy": res["fp32"]["accuracy"],
            "llvm_allocated_bytes": res["memory"]["allocated_bytes"],
            "fp32_step_bytes": res["memory"]["fp32_measured"]["peak_bytes"],
            "mcu": mcu,
            "results": res,
        }
        rows.append(row)
        print(
            f"   integer {100 * row['integer_accuracy']:.2f} %  fp32 "
            f"{100 * row['fp32_accuracy']:.2f} %  llvm {row['llvm_allocated_bytes']} B  "
            f"MCU b{MCU_BATCH} RAM {row['mcu']['ram']} B",
            flush=True,
        )
        write_json_atomic(args.out, {**provenance("mexc-bench-sparse-1", sys.argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
