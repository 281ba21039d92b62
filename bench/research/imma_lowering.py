"""How long TVM takes to produce an int8 tensor-core (IMMA) GEMM, beside mexc's dp4a schedule.

    python bench/research/imma_lowering.py [--m 256 --n 512 --k 576]

Schedules one int8 GEMM with TVM's `dlight` MatmulInt8Tensorization (WMMA fragments; its
software-pipeline annotations are removed, which TVM 0.27 cannot lower for wmma), and the same
GEMM with mexc's dp4a schedule, emits CUDA for sm_80 and reports seconds and the number of
mma_sync / __dp4a calls in the source. Prints a table; writes bench/results/imma_lowering.json.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tvm  # noqa: E402
from tvm.s_tir.dlight.gpu.matmul import MatmulInt8Tensorization  # noqa: E402

from mexc.backends.cuda.products import cuda_source, schedule_gemm_dp4a  # noqa: E402
from mexc.lowering.gemm_forms import gemm_func  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

PIPELINE = ("software_pipeline_stage", "software_pipeline_order", "software_pipeline_async_stages")


def imma_source(m: int, n: int, k: int, target: tvm.target.Target) -> str:
    a = tvm.te.placeholder((m, k), "int8", name="A")
    b = tvm.te.placeholder((n, k), "int8", name="B")
    r = tvm.te.reduce_axis((0, k), "r")
    c = tvm.te.compute(
        (m, n), lambda i, j: tvm.te.sum(a[i, r].astype("int32") * b[j, r].astype("int32"), axis=r)
    )
    func = tvm.te.create_prim_func([a, b, c]).with_attr("global_symbol", "gemm")
    sch = MatmulInt8Tensorization().apply(func, target, False)
    assert sch is not None, "dlight did not match the GEMM"
    for name in set(re.findall(r'T\.sblock\("([^"]+)"', sch.mod.script())) - {"root"}:
        for loop in sch.get_loops(sch.get_sblock(name)):
            for key in PIPELINE:
                if key in sch.get(loop).annotations:
                    sch.unannotate(loop, key)
    ex = tvm.compile(sch.mod, target=target)
    return str(ex.mod.imports[0].inspect_source())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "imma_lowering.json"))
    args = ap.parse_args(argv)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80", "host": {"kind": "llvm"}})
    t0 = time.perf_counter()
    dp4a = cuda_source(
        {"gemm": schedule_gemm_dp4a(gemm_func(1, args.m, args.n, args.k, "gemm"))}, "sm_80"
    )
    t_dp4a = time.perf_counter() - t0
    t0 = time.perf_counter()
    imma = imma_source(args.m, args.n, args.k, target)
    t_imma = time.perf_counter() - t0
    rows = [
        {"schedule": "mexc dp4a", "seconds": round(t_dp4a, 2), "calls": dp4a.count("__dp4a(")},
        {"schedule": "dlight IMMA", "seconds": round(t_imma, 2), "calls": imma.count("mma_sync")},
    ]
    print(f"int8 GEMM {args.m}x{args.n}x{args.k}, sm_80 source")
    for r in rows:
        print(f"{r['schedule']:12s} {r['seconds']:8.2f} s   {r['calls']} dp4a / mma_sync calls")
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-imma-lowering-1", ["python", *sys.argv]),
            "gemm": [args.m, args.n, args.k],
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
