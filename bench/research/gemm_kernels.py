"""The host GEMM kernels side by side: cpu_gemm's int32 tile and its byte-product (AVX2) kernel.

For each shape (M x K x Q, the training-step products of the example models), both kernels get
the same packed operands and their results are checked against numpy; the table shows the best
of `--repeats` runs of the GEMM kernel alone, its GMAC/s, and the byte kernel's extra pass that
regroups B into column panels (`interleave_b`), threaded as the compiled step (`kernel_timing`).

    python bench/research/gemm_kernels.py [--repeats 10] [--out bench/results/gemm_kernels.json]
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
from mexc.lowering import gemm_forms as gf  # noqa: E402
from mexc.lowering.cpu_gemm import CpuGemm, cpu_gemm  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

# (what, M, K, Q): rows of A (output channels), depth, columns (batch x pixels or taps)
SHAPES = [
    ("FashionCNN conv 2 forward", 32, 144, 25088),
    ("SmallResNet 16-channel conv forward", 16, 144, 131072),
    ("SmallResNet 64-channel conv forward", 64, 576, 8192),
    ("weight gradient (taps x channels)", 144, 100352, 64),
]
# (a first convolution, K = 9, is not here: cpu_gemm keeps the int32 tile for K < 16, so both
# columns would time the same kernel; measured before that rule: 0.77x, docs/cpu.md)


def measure(cg: CpuGemm, x: np.ndarray, w: np.ndarray, repeats: int) -> dict[str, float]:
    ex = tvm.compile(cg.module(), target=host_cpu().target())
    t = tvm.runtime.tensor
    a, c = t(np.zeros(cg.a_shape, np.int8)), t(np.zeros(cg.c_shape, np.int32))
    b = t(np.zeros(cg.b_shape, np.int8))
    rows = t(np.zeros(cg.b_rows_shape, np.int8)) if cg.b_rows_shape else b
    ex["pack_a"](t(x), a)
    ex["pack_b"](t(w), rows)
    out = {"interleave_s": 0.0}
    if cg.interleave_b is not None:
        out["interleave_s"] = best_seconds(ex["interleave_b"], [rows, b], repeats)
    out["gemm_s"] = best_seconds(ex["gemm"], [a, b, c], repeats)
    m, q = x.shape[0], w.shape[0]
    want = x.astype(np.int64) @ w.astype(np.int64).T
    if not np.array_equal(c.numpy()[0, :m, :q], want):
        raise SystemExit("a GEMM kernel gave a wrong product")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gemm_kernels.json"))
    args = ap.parse_args()
    if host_cpu().gemm_kernel != "avx2_i8":
        raise SystemExit("this host has no AVX2: only the int32 tile is built here")
    rng = np.random.default_rng(0)
    rows = []
    print(
        f"{'product':38} {'M x K x Q':>20} {'int32 ms':>9} {'bytes ms':>9} "
        f"{'+panels ms':>10} {'GMAC/s int32':>12} {'GMAC/s bytes':>12} {'speed-up':>8}"
    )
    for what, m, k, q in SHAPES:
        x = rng.integers(-127, 128, (m, k)).astype(np.int8)
        w = rng.integers(-127, 128, (q, k)).astype(np.int8)
        form = gf.linear_forward("g", m, k, q)  # acc[m, q] = sum_k x[m, k] w[q, k]
        old = measure(cpu_gemm(form, 8, kernel="int32"), x, w, args.repeats)
        new = measure(cpu_gemm(form, 8, kernel="avx2_i8"), x, w, args.repeats)
        macs = m * k * q
        row = {
            "product": what,
            "m": m,
            "k": k,
            "q": q,
            "int32_gemm_s": old["gemm_s"],
            "bytes_gemm_s": new["gemm_s"],
            "bytes_interleave_s": new["interleave_s"],
            "speedup_gemm": old["gemm_s"] / new["gemm_s"],
            "speedup_with_interleave": old["gemm_s"] / (new["gemm_s"] + new["interleave_s"]),
        }
        rows.append(row)
        print(
            f"{what:38} {f'{m} x {k} x {q}':>20} {old['gemm_s'] * 1e3:9.2f} "
            f"{new['gemm_s'] * 1e3:9.2f} {new['interleave_s'] * 1e3:10.2f} "
            f"{macs / old['gemm_s'] / 1e9:12.1f} {macs / new['gemm_s'] / 1e9:12.1f} "
            f"{row['speedup_gemm']:8.2f}"
        )
    write_json_atomic(args.out, {**provenance("mexc-bench-gemm-kernels-1"), "rows": rows})
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
