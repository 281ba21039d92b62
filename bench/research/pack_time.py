"""Time of the llvm backend's operand packs (im2col and friends) for convolution geometries.

For each geometry at batch 128: pack_b of the forward (im2col of x), pack_b of the input
gradient (the transposed-convolution gather of dy; the one-GEMM form, which the plan keeps for
strides that do not divide the input) and pack_b of the weight gradient, built by
`cpu_gemm.cpu_gemm` for this CPU, median of 15 calls, with the bytes written and GB/s. Prints a
table and writes bench/results/pack_time.json.

    python bench/research/pack_time.py [--out bench/results/pack_time.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mexc.backends.llvm.step  # noqa: E402,F401  (sets TVM_NUM_THREADS to the usable CPUs)
from mexc.backends.llvm.products import host_cpu  # noqa: E402
from mexc.lowering import gemm_forms as gf  # noqa: E402
from mexc.lowering.cpu_gemm import cpu_gemm, swapped  # noqa: E402
from mexc.lowering.te_products import ConvGeom  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

GEOMETRIES = {
    "fashion conv1 1->16 28x28": ConvGeom.of(128, 1, 28, 28, 16, 3, 3, 1, 1),
    "fashion conv2 16->32 14x14": ConvGeom.of(128, 16, 14, 14, 32, 3, 3, 1, 1),
    "resnet 32->64 16x16 stride 2": ConvGeom.of(128, 32, 16, 16, 64, 3, 3, 2, 1),
    "depthwise 64 16x16": ConvGeom.of(128, 64, 16, 16, 64, 3, 3, 1, 1, 64),
}


def _median_ms(fn: Any, *args: Any) -> float:
    fn(*args)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def _pack_b(form: gf.GemmForm, k_dims: tuple, q_dims: tuple, m_dims: tuple | None) -> dict:
    cpu = host_cpu()
    cg = cpu_gemm(form, cpu.lanes32, k_dims, q_dims, m_dims)
    ex = tvm.compile(tvm.IRModule({"f": cg.pack_b.with_attr("global_symbol", "f")}), cpu.target())
    dev = tvm.cpu()
    src_shape = form.operands[form.b_src].shape
    rng = np.random.default_rng(0)
    src = tvm.runtime.tensor(rng.integers(-127, 128, src_shape).astype(np.int8), dev)
    out = tvm.runtime.empty(cg.b_pack_shape, "int8", dev)
    ms = _median_ms(ex["f"], src, out)
    mb = int(np.prod(cg.b_pack_shape)) / 1e6
    return {"ms": round(ms, 3), "mb": round(mb, 2), "gb_s": round(mb / ms, 2)}


def measure(g: ConvGeom) -> dict[str, dict]:
    taps, pixels = (g.cg, g.kh, g.kw), (g.n, g.oh, g.ow)
    return {
        "forward": _pack_b(gf.conv_forward("f", g), taps, pixels, (g.og,)),
        "input grad": _pack_b(
            gf.conv_grad_input("d", g), (g.og, g.kh, g.kw), (g.n, g.h, g.w), None
        ),
        "weight grad": _pack_b(swapped(gf.conv_grad_weight("w", g)), pixels, (g.og,), taps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pack_time.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'geometry':<30} {'pack':<12} {'ms':>8} {'MB':>7} {'GB/s':>6}")
    for name, g in GEOMETRIES.items():
        for pack, r in measure(g).items():
            rows.append({"geometry": name, "pack": pack, **r})
            print(f"{name:<30} {pack:<12} {r['ms']:>8.3f} {r['mb']:>7.2f} {r['gb_s']:>6.2f}")
    out = Path(args.out)
    write_json_atomic(
        out, {**provenance("mexc-bench-pack-time-1", ["python", *sys.argv]), "rows": rows}
    )
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
