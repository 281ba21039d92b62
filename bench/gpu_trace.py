"""Find the kernels a GPU gets wrong: the CPU emulator's step, kernel by kernel, replayed on the
GPU in lockstep.

    python bench/gpu_trace.py --prepare build/gpu-trace/fashion-b16   # here (TVM, nvcc, g++)
    python bench/gpu_trace.py build/gpu-trace/fashion-b16             # GPU machine (CuPy)

--prepare builds the artifact of a small training step (`--model`, `--batch`; sm_80 and sm_90),
runs its first step through the emulator (mexc.backends.cuda.emulator, one allocation per
buffer) and stores in trace.npz every buffer after the inputs are written and every buffer a
kernel changed, after that kernel (a buffer over --max-bytes as its SHA-256 only: such a buffer
is compared but cannot be set back, so the kernels after a mismatch in it are suspect). On the
GPU the same step runs one kernel at a time; after each, every buffer the kernel names is read
back and compared with the emulator's. A kernel
whose result differs *although its inputs were the emulator's* is a kernel the GPU computes
differently: it is reported (symbol, buffer, how many elements differ, the first of them) and
its buffers are set to the emulator's before the next kernel, so every later kernel is judged on
its own. The inputs and results of the first few such kernels go to $OUT/trace_kernels.npz;
the report to $OUT/trace.json (and stdout). Exits 1 when any kernel differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEEP = 6  # kernels whose buffers are saved in full


def _bases(man: dict[str, Any], args: list[str]) -> list[str]:
    """The buffers (not views) a kernel's arguments live in, once each, in argument order."""
    views = man["views"]
    out: list[str] = []
    for a in args:
        b = views[a][0] if a in views else a
        if b not in out:
            out.append(b)
    return out


def _key(at: str, buffer: str, values: np.ndarray, max_bytes: int) -> str:
    """trace.npz's key of `buffer`'s contents after `at` ("init" or "k<kernel>"):
    "<at>|<buffer>", or "<at>#<buffer>" where only the SHA-256 is kept (over max_bytes)."""
    return f"{at}{'#' if values.nbytes > max_bytes else '|'}{buffer}"


def _stored(values: np.ndarray, max_bytes: int) -> np.ndarray:
    if values.nbytes > max_bytes:
        return np.frombuffer(hashlib.sha256(values.tobytes()).digest(), np.uint8)
    return values.copy()


def prepare(folder: Path, model: str, batch: int, max_bytes: int) -> None:
    import make_gpu_artifacts as mk

    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import load_emulated

    spec = mk.TARGETS[model]
    prog = mk._program(spec[0], spec[1], batch, spec[6])
    build_step(prog, ("sm_80", "sm_90"), folder)
    x, y = mk.check_batch(prog, folder)
    emu = load_emulated(folder, layout="separate")
    man = emu.plan
    emu._write_inputs(emu._check_x(x, exact_batch=True), emu._check_y(y, emu.batch))
    t = emu._t
    saved = {_key("init", b, t[b], max_bytes): _stored(t[b], max_bytes) for b in man["buffers"]}
    current = {b: t[b].copy() for b in man["buffers"]}
    for i, ((_, launch, _), (*_, args)) in enumerate(zip(emu._calls, man["kernels"])):
        launch(False)
        for b in _bases(man, args):
            if not np.array_equal(t[b], current[b]):
                current[b] = t[b].copy()
                saved[_key(f"k{i}", b, t[b], max_bytes)] = _stored(t[b], max_bytes)
    np.savez_compressed(folder / "trace.npz", **saved)
    size = (folder / "trace.npz").stat().st_size
    print(f"{folder}: {len(man['kernels'])} kernels traced, trace.npz {size / 2**20:.1f} MiB")


def _is_digest(want: np.ndarray, got: np.ndarray) -> bool:
    return want.dtype == np.uint8 and want.shape == (32,) and got.shape != (32,)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """`got` equals the contents `want`, or has the SHA-256 `want` (_stored)."""
    if _is_digest(want, got):
        return hashlib.sha256(np.ascontiguousarray(got).tobytes()).digest() == want.tobytes()
    return np.array_equal(got, want)


def _first_differences(got: np.ndarray, want: np.ndarray, n: int = 8) -> list[list[Any]]:
    flat_g, flat_w = got.reshape(-1), want.reshape(-1)
    idx = np.flatnonzero(flat_g != flat_w)[:n]
    return [[int(i), int(flat_g[i]), int(flat_w[i])] for i in idx]


def replay(folder: Path) -> int:
    from mexc.backends.cuda.program import load_cuda

    prog = load_cuda(folder, graph=False, layout="separate")
    man = prog.plan
    trace = np.load(folder / "trace.npz")
    stored = {key.replace("#", "|"): key for key in trace.files}  # either form by "|" name
    batch = np.load(folder / "check.npz")
    x, y = prog._check_x(batch["x"], exact_batch=True), prog._check_y(batch["y"], prog.batch)
    prog._write_inputs(x, y)
    current = {b: trace[stored[f"init|{b}"]] for b in man["buffers"]}
    report: dict[str, Any] = {"artifact": str(folder), "arch": prog.arch}
    report.update(initial=[], kernels=[])
    for b, want in current.items():
        got = prog._read(b)
        if not _same(got, want):
            report["initial"].append(b)
            if not _is_digest(want, got):
                prog._write(b, want)
    kept: dict[str, np.ndarray] = {}
    for i, (call, (_, symbol, grid, block, args)) in enumerate(zip(prog._calls, man["kernels"])):
        bases = _bases(man, args)
        before = {b: current[b] for b in bases}
        prog._launch([call])
        prog.synchronize()
        wrong: list[dict[str, Any]] = []
        for b in bases:
            if f"k{i}|{b}" in stored:
                current[b] = trace[stored[f"k{i}|{b}"]]
            got = prog._read(b)
            if _same(got, current[b]):
                continue
            if _is_digest(current[b], got):  # no contents to resync: later kernels suspect
                wrong.append({"buffer": b, "digest_only": True})
                continue
            diff = int((got != current[b]).sum())
            first = _first_differences(got, current[b])
            wrong.append({"buffer": b, "differ": diff, "of": int(got.size), "first": first})
            if len(report["kernels"]) < KEEP:
                kept[f"k{i}|got|{b}"] = got
            prog._write(b, current[b])  # back in step with the emulator
        if not wrong:
            continue
        if len(report["kernels"]) < KEEP:
            for b in bases:
                kept[f"k{i}|in|{b}"] = before[b]
                kept[f"k{i}|want|{b}"] = current[b]
        entry = {"index": i, "symbol": symbol, "grid": grid, "block": block, "args": args}
        report["kernels"].append({**entry, "wrong": wrong})
        print(f"kernel {i} {symbol} grid {grid} block {block}: {wrong}", flush=True)
    print(f"{len(report['kernels'])} of {len(man['kernels'])} kernels differ on the GPU")
    out = os.environ.get("OUT")
    if out:
        Path(out, "trace.json").write_text(json.dumps(report, indent=1))
        if kept:
            np.savez_compressed(Path(out, "trace_kernels.npz"), **kept)
    return 1 if report["kernels"] or report["initial"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--prepare", action="store_true", help="build and trace here")
    ap.add_argument("--model", default="fashion", help="a name of make_gpu_artifacts.TARGETS")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-bytes", type=int, default=1 << 20, help="larger: SHA-256 only")
    args = ap.parse_args(argv)
    if args.prepare:
        sys.path.insert(0, str(ROOT / "bench"))
        prepare(args.folder, args.model, args.batch, args.max_bytes)
        return 0
    return replay(args.folder)


if __name__ == "__main__":
    sys.exit(main())
