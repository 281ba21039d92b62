"""GPU check of offline-compiled product kernels: run each kernel set on the GPU with the same
deterministic operands the host used, compare SHA-256 digests of the accumulators.

    python -m mexc.cuda_check ARTIFACT_DIR [ARTIFACT_DIR ...]

Each folder comes from `bench/make_gpu_artifacts.py` (products.json, the cubin, expected.json).
Needs CuPy and a GPU, not TVM. Prints a table; writes cuda_check.json to $OUT when set; exits 1
on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mexc.cuda_runtime import ProductArtifact, deterministic_operands, digest


def check(folder: Path) -> list[dict[str, object]]:
    art = ProductArtifact.load(folder)
    expected = json.loads((folder / "expected.json").read_text())["kernel_sets"]
    rows = []
    for name, exp in expected.items():
        index = int(exp["product"])
        ops = deterministic_operands(art.operand_specs(index), index)
        art.run(index, ops)  # warm-up (module load, allocation)
        t0 = time.perf_counter()
        acc = art.run(index, ops)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "artifact": folder.name,
                "kernels": name,
                "exact": digest(acc) == exp["sha256"],
                "ms": round(1e3 * seconds, 3),
                "gops": round(2 * exp["macs"] / seconds / 1e9, 1) if seconds else 0.0,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    folders = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not folders:
        print(__doc__)
        return 2
    rows = [row for f in folders for row in check(f)]
    for r in rows:
        print(
            f"{r['artifact']:18s} {'ok ' if r['exact'] else 'BAD'} {r['ms']:9.3f} ms "
            f"{r['gops']:8.1f} GOPS  {r['kernels']}"
        )
    bad = sum(not r["exact"] for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} kernel sets bit-exact")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cuda_check.json").write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
