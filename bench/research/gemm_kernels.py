"""The host GEMM kernels side by side: cpu_gemm's int32 tile and its byte-product kernels.

For each shape (M x K x Q, the training-step products of the example models), every kernel the
host can run (the int32 tile; the AVX2 byte kernel; vpdpbusd on VNNI hosts) gets
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


def host_kernels() -> dict[str, int]:
    """The GEMM kernels this host can run, each with its int32 lanes: the int32 tile at the
    host's vector width, the AVX2 byte kernel on any AVX2 host, vpdpbusd where it has VNNI."""
    cpu = host_cpu()
    kernels = {"int32": cpu.lanes32}
    if cpu.gemm_kernel != "int32":
        kernels["avx2_i8"] = 8
    if cpu.vnni256:
        kernels["vnni_i8"] = 8
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gemm_kernels.json"))
    args = ap.parse_args()
    kernels = host_kernels()
    rng = np.random.default_rng(0)
    rows = []
    head = "".join(f" {k + ' ms':>11} {'GMAC/s':>7}" for k in kernels)
    print(f"{'product':38} {'M x K x Q':>20}{head} {'+panels ms':>10}")
    for what, m, k, q in SHAPES:
        x = rng.integers(-127, 128, (m, k)).astype(np.int8)
        w = rng.integers(-127, 128, (q, k)).astype(np.int8)
        form = gf.linear_forward("g", m, k, q)  # acc[m, q] = sum_k x[m, k] w[q, k]
        got = {
            kn: measure(cpu_gemm(form, lanes, kernel=kn), x, w, args.repeats)
            for kn, lanes in kernels.items()
        }
        macs = m * k * q
        row: dict[str, object] = {"product": what, "m": m, "k": k, "q": q}
        for kn, r in got.items():
            row[f"{kn}_gemm_s"] = r["gemm_s"]
            row[f"{kn}_gmac_per_s"] = macs / r["gemm_s"] / 1e9
        row["panels_interleave_s"] = max(r["interleave_s"] for r in got.values())
        rows.append(row)
        cells = "".join(
            f" {r['gemm_s'] * 1e3:11.2f} {macs / r['gemm_s'] / 1e9:7.1f}" for r in got.values()
        )
        print(f"{what:38} {f'{m} x {k} x {q}':>20}{cells} {row['panels_interleave_s'] * 1e3:10.2f}")
    out = {**provenance("mexc-bench-gemm-kernels-2"), "kernels": kernels, "rows": rows}
    write_json_atomic(args.out, out)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
