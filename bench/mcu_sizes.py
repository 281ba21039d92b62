"""MCU footprint and instructions per step of the exported C training programs.

Exports the digits CNN (batch 8) and the Fashion CNN (batch 4), builds each for Cortex-M0/M3/M4
(soft-float ABI) and reports flash (.text incl. .rodata + .data) and RAM (.data + .bss +
worst-case stack from the call graph). Then, on every QEMU board of `MCU_BOARDS` whose SRAM
holds the program, runs it, checks its STATE against the reference and reads the instructions
of each step (`step K loss L insns N`: SysTick over QEMU's -icount clock, docs/mcu.md), and
divides them by the step's multiply-accumulates (its products' m*q*k, as the launch plan
counts them). Prints the tables and writes bench/results/mcu_sizes.json.

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
from mexc.backends.c.project import MCU_BOARDS  # noqa: E402
from mexc.data import load_digits, load_fashion_mnist  # noqa: E402
from mexc.lowering import plan_core, step_plan  # noqa: E402
from mexc.lowering.devices import device_of  # noqa: E402

CASES = {
    "digits-cnn": (DigitsCNN, (1, 8, 8), 8, load_digits, 10, 64 * 1024),
    "fashion-cnn": (FashionCNN, (1, 28, 28), 4, load_fashion_mnist, 4, 256 * 1024),
}


def step_macs(prog: mexc.Program) -> int:
    """Multiply-accumulates of one training step: every product's m*q*k in the host launch
    plan (no lean node: each product once)."""
    total = 0
    count = plan_core.PlanBuilder.gemm_work

    def counting(self: plan_core.PlanBuilder, form: object) -> None:
        nonlocal total
        total += int(form.macs)  # type: ignore[attr-defined]
        count(self, form)  # type: ignore[arg-type]

    plan_core.PlanBuilder.gemm_work = counting  # type: ignore[method-assign]
    try:
        step_plan.plan_builder(prog, 8, device_of("cpu"), "int32", None, {}, None)
    finally:
        plan_core.PlanBuilder.gemm_work = count  # type: ignore[method-assign]
    return total


def step_insns(out: str) -> list[int]:
    return [int(ln.split()[-1]) for ln in out.splitlines() if ln.startswith("step ")]


def run_case(name: str, work: Path) -> dict[str, object]:
    cls, shape, batch, loader, steps, budget = CASES[name]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(batch, *shape),))
    x, y = loader("train")
    data = (x[: 4 * batch], y[: 4 * batch])
    boards = {b: mexc.export(prog, work / f"{name}-{b}", data, steps, b) for b in MCU_BOARDS}
    project = boards["mps2-an385"]  # the sizes: its Makefile builds for any CPU
    macs = step_macs(prog)
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
    row["macs_per_step"] = macs
    ram = measure(project, "cortex-m3").ram
    for board, spec in MCU_BOARDS.items():
        if ram > spec.ram:
            row[board] = {"fits": False, "ram": ram, "board_ram": spec.ram}
            continue
        folder = boards[board]
        t0 = time.perf_counter()
        cmd = ["make", "-s", "-C", str(folder), "run-qemu"]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out = run.stdout + run.stderr
        state = [ln.split()[1] for ln in out.splitlines() if ln.startswith("STATE ")]
        insns = sorted(step_insns(out))
        median = insns[len(insns) // 2]
        row[board] = {
            "fits": True,
            "cpu": spec.cpu,
            "qemu_seconds": round(time.perf_counter() - t0, 2),
            "bit_exact": bool(state) and state[-1] == row["reference_state"],
            "insns_per_step": insns,
            "median_insns_per_step": median,
            "insns_per_mac": round(median / macs, 2),
        }
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
        f"{'budget B':>9}"
    )
    for r in rows:
        for cpu in ("cortex-m0", "cortex-m3", "cortex-m4"):
            s = r[cpu]
            assert isinstance(s, dict)
            print(
                f"{r['model']:<12} {r['batch']:>5} {cpu:<10} {s['flash']:>9} {s['ram']:>9} "
                f"{s['stack']:>8} {r['ram_budget']:>9}"
            )
    print(
        f"\n{'model':<12} {'board':<14} {'cpu':<11} {'insns/step':>12} {'MACs/step':>10} "
        f"{'insns/MAC':>9} {'bit-exact':>9}"
    )
    for r in rows:
        for board in MCU_BOARDS:
            b = r[board]
            assert isinstance(b, dict)
            if not b["fits"]:
                need = f"needs {b['ram']} B of RAM, has {b['board_ram']}"
                print(f"{r['model']:<12} {board:<14} {need}")
                continue
            print(
                f"{r['model']:<12} {board:<14} {b['cpu']:<11} {b['median_insns_per_step']:>12} "
                f"{r['macs_per_step']:>10} {b['insns_per_mac']:>9} {str(b['bit_exact']):>9}"
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
