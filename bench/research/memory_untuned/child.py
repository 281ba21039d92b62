"""One fresh-process measurement.

    python child.py MODEL BATCH WHO [TARGET]

WHO: mexc | fp32; TARGET: llvm (default) | reference

Prints one JSON line: RSS (KiB) at phases, peak RSS (VmHWM) overall and during the steps only
(HWM reset through /proc/self/clear_refs before the steps), memory_report (mexc) or
fp32.step_memory (fp32, measured after the RSS figures were read).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        lines = fh.readlines()
    for line in lines:
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


STEPS = 3


def main() -> None:
    name, b, who = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    target = sys.argv[4] if len(sys.argv) > 4 else "llvm"
    import models
    import numpy as np  # noqa: F401
    import torch

    rec: dict = {"model": name, "batch": b, "who": who, "target": target}
    x, y = models.batch(name, b)
    model = models.build(name)
    import mexc

    rec["rss_imports"] = status()["VmRSS"]
    t0 = time.time()
    if who == "fp32":
        from mexc.fp32 import step_memory

        fresh = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        reset_hwm()
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(xt), yt).backward()
            opt.step()
        s = status()
        rec["hwm_total"] = s["VmHWM"]
        rec["hwm_steps"] = s["VmHWM"]
        rec["rss_after"] = s["VmRSS"]
        rec["step_s"] = time.time() - t0
        rec["fp32"] = step_memory(fresh, xt, yt)
    else:
        prog = mexc.compile(model, (torch.from_numpy(x),), target=target)
        rec["compile_s"] = time.time() - t0
        s = status()
        rec["rss_compiled"], rec["hwm_compile"] = s["VmRSS"], s["VmHWM"]
        reset_hwm()
        t1 = time.time()
        losses = [float(prog.step(x, y)) for _ in range(STEPS)]
        rec["step_s"] = (time.time() - t1) / STEPS
        s = status()
        rec["hwm_steps"], rec["rss_after"] = s["VmHWM"], s["VmRSS"]
        rec["hwm_total"] = max(rec["hwm_compile"], rec["hwm_steps"])
        rec["losses"] = losses
        rec["report"] = {k: v for k, v in prog.memory_report().items()}
        rec["allocated"] = prog.allocated_bytes()
        rec["target_got"] = prog.options.target
    print(json.dumps(rec))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
