"""Data-parallel GPU check: two workers run the CUDA step of one artifact with its collectives
between the kernels, and must end every step with the state of one process on the whole batch.

    python bench/gpu_dp_check.py --prepare build/gpu/fashion-dp   # build machine (TVM, nvcc)
    python bench/gpu_dp_check.py build/gpu/fashion-dp              # GPU machine (CuPy, torch)
    python bench/gpu_dp_check.py build/gpu/fashion-dp --emulate    # anywhere with g++

--prepare writes the worker artifact of FashionCNN at a global batch of 16 split over 2 workers
(sm_80 and sm_90), the whole program (whole.mexc), the batches (check.npz) and expected.json:
one process's loss and state checksum after every step, from the reference executor.

The check starts 2 workers on localhost (mexc.distributed.launch). Both share GPU 0, so the
group is gloo (NCCL takes one GPU per worker), and gloo reduces the device buffers in place,
ordered on the program's stream (TorchCollectives.reduce_in_place). That checks the artifact's
collectives, their stream order and the CUDA graphs between them; NCCL itself needs two GPUs.
--emulate runs the same workers with the artifact's CUDA source emulated on the CPU. Prints a
line per step; writes dp_check.json to $OUT when set; exits 1 unless bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL, SHAPE, BATCH, WORLD, STEPS = "FashionCNN", (1, 28, 28), 16, 2, 3


def prepare(folder: Path, archs: tuple[str, ...]) -> None:
    """The worker artifact, the whole program, the batches and one process's results."""
    import torch

    import mexc
    from examples.models import EXAMPLES
    from mexc.backends.cuda.build import build_step
    from mexc.distributed import Workers
    from mexc.targets import worker_program

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    whole = mexc.compile(EXAMPLES[MODEL][0](), (torch.zeros(BATCH, *SHAPE),))
    whole.save(folder / "whole.mexc")
    worker = worker_program(whole, Workers(0, WORLD, None))  # type: ignore[arg-type]
    man = build_step(worker, archs, folder)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((STEPS, BATCH, *SHAPE)).astype(np.float32)
    ys = rng.integers(0, 10, (STEPS, BATCH))
    np.savez(folder / "check.npz", x=xs, y=ys)
    losses = [whole.step(x, y) for x, y in zip(xs, ys)]
    expected = {"losses": losses, "checksum": whole.state_checksum(), "world": WORLD}
    (folder / "expected.json").write_text(json.dumps(expected))
    print(
        f"{folder}: {len(man['kernels'])} kernels, {len(man['collectives'])} collectives, "
        f"one process's checksum {expected['checksum']}"
    )


def worker_main(folder: Path, emulate: bool, out: Path) -> None:
    """One worker (started by `check`): its rows of every batch through the artifact."""
    from mexc.backends.cuda.program import StepArtifact
    from mexc.distributed import init_from_env, shard_rows
    from mexc.printer import print_graph
    from mexc.program import read_checkpoint
    from mexc.targets import as_data_parallel_worker

    workers = init_from_env("gloo")  # both workers on one GPU: no NCCL (see above)
    worker = as_data_parallel_worker(read_checkpoint(folder / "whole.mexc"), "reference")
    artifact = StepArtifact.load(folder)
    if print_graph(artifact.program.graph) != print_graph(worker.graph):
        raise SystemExit(f"{folder}: the artifact is not this worker's step")
    prog: object
    if emulate:
        from mexc.backends.cuda.emulator import EmulatedCudaProgram

        prog = EmulatedCudaProgram(artifact, program=worker.retargeted("cuda"))
    else:
        from mexc.backends.cuda.program import CudaProgram

        prog = CudaProgram(artifact, 0, program=worker.retargeted("cuda"))
    batches = np.load(folder / "check.npz")
    rows = []
    for x, y in zip(batches["x"], batches["y"]):
        t0 = time.perf_counter()
        loss = prog.step(
            shard_rows(x, workers.rank, workers.world), shard_rows(y, workers.rank, workers.world)
        )  # type: ignore[attr-defined]
        rows.append({"loss": loss, "seconds": round(time.perf_counter() - t0, 4)})
    result = {"steps": rows, "checksum": prog.state_checksum()}  # type: ignore[attr-defined]
    (out / f"rank{workers.rank}.json").write_text(json.dumps(result))


def check(folder: Path, emulate: bool) -> int:
    import tempfile

    from mexc.distributed import launch

    expected = json.loads((folder / "expected.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, str(folder), "--worker", tmp]
        cmd += ["--emulate"] if emulate else []
        codes = launch(cmd, expected["world"], timeout_s=300)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    exact = codes == [0] * expected["world"] and len(ranks) == expected["world"]
    for r, got in enumerate(ranks):
        losses = [s["loss"] for s in got["steps"]]
        same = losses == expected["losses"] and got["checksum"] == expected["checksum"]
        exact &= same
        print(
            f"worker {r}: losses {losses} checksum {got['checksum']} "
            f"{'==' if same else '!='} one process ({expected['checksum']}); "
            f"s/step {[s['seconds'] for s in got['steps']]}"
        )
    report = {"folder": str(folder), "emulated": emulate, "workers": ranks, "bit_exact": exact}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "dp_check.json").write_text(json.dumps(report, indent=1))
    print("data-parallel: bit-exact with one process" if exact else "data-parallel: MISMATCH")
    return 0 if exact else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--prepare", action="store_true", help="build the artifact here")
    ap.add_argument("--archs", default="sm_80,sm_90")
    ap.add_argument("--emulate", action="store_true", help="the CPU emulator, not the GPU")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set by check's launch
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.folder, tuple(args.archs.split(",")))
        return 0
    if args.worker:
        worker_main(args.folder, args.emulate, args.worker)
        return 0
    return check(args.folder, args.emulate)


if __name__ == "__main__":
    sys.exit(main())
