"""MCU footprint of the exported C training programs (issue: C backend).

Exports the digits CNN (batch 8) and the Fashion CNN (batch 4), builds each for Cortex-M0/M3/M4
(soft-float ABI), runs the M3 image under QEMU and checks its STATE against the reference, and
reports flash (.text incl. .rodata + .data) and RAM (.data + .bss + worst-case stack from the
call graph). Prints a table and writes bench/results/mcu_sizes.json.

    python bench/mcu_sizes.py
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import DigitsCNN, FashionCNN  # noqa: E402
from mexc.backends.c.mcu_sizes import measure  # noqa: E402
from mexc.data import load_digits, load_fashion_mnist  # noqa: E402

CASES = {
    "digits-cnn": (DigitsCNN, (1, 8, 8), 8, load_digits, 10, 64 * 1024),
    "fashion-cnn": (FashionCNN, (1, 28, 28), 4, load_fashion_mnist, 4, 256 * 1024),
}


def run_case(name: str, work: Path) -> dict[str, object]:
    cls, shape, batch, loader, steps, budget = CASES[name]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(batch, *shape),))
    x, y = loader("train")
    data = (x[: 4 * batch], y[: 4 * batch])
    project = mexc.export(prog, work / name, data=data, steps=steps)
    prog.replay(data, steps)
    row: dict[str, object] = {
        "model": name,
        "batch": batch,
        "steps": steps,
        "ram_budget": budget,
        "reference_state": prog.state_checksum(),
    }
    for cpu in ("cortex-m0", "cortex-m3", "cortex-m4"):
        subprocess.run(["make", "-s", "-C", str(project), "mcu", f"CPU={cpu}"], check=True)
        s = measure(project, cpu)
        row[cpu] = {
            "flash": s.flash,
            "text": s.text,
            "data": s.data,
            "bss": s.bss,
            "stack": s.stack,
            "ram": s.ram,
        }
    t0 = time.perf_counter()
    run = subprocess.run(
        ["make", "-s", "-C", str(project), "run-qemu"], capture_output=True, text=True, check=True
    )
    row["qemu_seconds"] = round(time.perf_counter() - t0, 2)
    state = [
        ln.split()[1] for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("STATE ")
    ]
    row["qemu_state"] = state[-1] if state else None
    row["bit_exact"] = row["qemu_state"] == row["reference_state"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mcu_sizes.json"))
    args = ap.parse_args()
    rows = []
    with TemporaryDirectory() as tmp:
        for name in CASES:
            rows.append(run_case(name, Path(tmp)))
    print(
        f"{'model':<12} {'batch':>5} {'cpu':<10} {'flash B':>9} {'RAM B':>9} {'stack B':>8} "
        f"{'budget B':>9} {'QEMU bit-exact':>15}"
    )
    for r in rows:
        for cpu in ("cortex-m0", "cortex-m3", "cortex-m4"):
            s = r[cpu]
            assert isinstance(s, dict)
            print(
                f"{r['model']:<12} {r['batch']:>5} {cpu:<10} {s['flash']:>9} {s['ram']:>9} "
                f"{s['stack']:>8} {r['ram_budget']:>9} {str(r['bit_exact']):>15}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "command": "python bench/mcu_sizes.py",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
