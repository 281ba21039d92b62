"""Time of the stochastic-rounding kernels alone: a compaction's shift-and-round and a two-term
aligned sum, as the llvm step schedules and threads them (best of `--repeats`).

    python bench/research/rounding_time.py [--repeats 20] [--out bench/results/rounding_time.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import tvm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernel_timing import best_seconds  # noqa: E402  (bench/research/, the script's folder)

from mexc.backends.llvm.products import host_cpu  # noqa: E402
from mexc.lowering import te_ops  # noqa: E402
from mexc.lowering.cpu_gemm import schedule_parallel  # noqa: E402
from mexc.lowering.te_compaction import compaction_apply  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/rounding_time.json"))
    args = ap.parse_args()
    rng, t, target = np.random.default_rng(0), tvm.runtime.tensor, host_cpu().target()
    rows = []

    shape = (128, 12544)  # FashionCNN's first convolution output as (rows, rest)
    apply = schedule_parallel(compaction_apply(shape, 8, False, True, "c"))
    fn = tvm.compile(tvm.IRModule({"c_apply": apply}), target=target)["c_apply"]
    acc = t(rng.integers(-(2**20), 2**20, shape).astype(np.int32))
    call = [acc, t(np.array([13], np.int32)), t(np.array([0xDEADBEEF], np.int64))]
    call.append(t(np.zeros(shape, np.int8)))
    rows.append(("compaction apply, shift 13", shape, best_seconds(fn, call, args.repeats)))

    shape4 = (128, 16, 32, 32)  # a SmallResNet residual sum
    total = schedule_parallel(te_ops.aligned_sum_acc(shape4, 2, True, "s", exponent_buffers=True))
    fn = tvm.compile(tvm.IRModule({"s": total}), target=target)["s"]
    ms = [t(rng.integers(-127, 128, shape4).astype(np.int8)) for _ in range(2)]
    for e1 in (-7, -40):  # no rounding needed / one term shifted right by 13
        call = [*ms, t(np.array([-5], np.int32)), t(np.array([e1], np.int32))]
        call += [t(np.array([123, 456], np.int64)), t(np.zeros(1, np.int32))]
        call.append(t(np.zeros(shape4, np.int32)))
        rows.append(
            (f"aligned sum of 2, exponents -5 and {e1}", shape4, best_seconds(fn, call, 20))
        )

    for what, shp, sec in rows:
        n = int(np.prod(shp))
        print(f"{what:40} {n:>10,} elements {sec * 1e3:8.3f} ms {n / sec / 1e9:6.2f} G elem/s")
    out = [{"kernel": w, "shape": list(s), "seconds": sec} for w, s, sec in rows]
    write_json_atomic(args.out, {**provenance("mexc-bench-rounding-time-1"), "rows": out})
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
