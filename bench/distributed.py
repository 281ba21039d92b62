"""Data-parallel training on localhost (gloo): mexc against PyTorch DDP in FP32.

    python bench/distributed.py [--models FashionCNN,MLP,ViTTiny] [--batch 64] [--workers 1,2,4]
        [--target auto] [--blocks 4] [--block-steps 3] [--out bench/results/distributed.json]

For each number of workers W, W processes (mexc.distributed.launch) train each model on the same
global batch: mexc's data-parallel step on `--target` ("auto": llvm where its step splits the
model, else the reference; the table names the target each model ran on; docs/distributed.md)
and PyTorch DDP FP32 (SGD with momentum), in alternating blocks of steps
with a pause between them. Each worker reports, per contender: the median seconds per step of
its blocks (worker 0's figure is the table's: every step ends at the same collective on every
worker), the payload bytes it contributed to collectives per step, and the number of
collectives per step (mexc: TorchCollectives' counts; DDP: a communication hook counting its
gradient buckets). W = 1 runs without a process group (plain compile, plain model). The mexc
state checksum after the run must equal the 1-worker one (checked). Prints a table; writes the
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mexc  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.vit import ViTTiny  # noqa: E402
from mexc.distributed import TorchCollectives, init_from_env, launch, shard_rows  # noqa: E402

SETTLE_S = 0.3
MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {**EXAMPLES, "ViTTiny": (ViTTiny, (1, 28, 28))}


def data(shape: tuple[int, ...], batch: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(batch, *shape)).astype(np.float32), rng.integers(0, 10, batch))
        for _ in range(steps)
    ]


def measure(name: str, args: argparse.Namespace, world: int, rank: int) -> dict[str, Any]:
    """One model's figures on this worker (see the module docstring)."""
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    net = cls()
    fp32 = cls()
    fp32.load_state_dict(net.state_dict())
    steps = 2 + args.blocks * args.block_steps
    batches = data(shape, args.batch, steps)
    x0 = torch.from_numpy(batches[0][0])
    prog = mexc.compile(net, (x0,), target=args.target, data_parallel=world > 1)
    comm = prog.workers.comm if prog.workers is not None else None
    assert comm is None or isinstance(comm, TorchCollectives)
    sent = {"bytes": 0, "calls": 0}
    ddp: nn.Module = fp32
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(fp32)

        # unannotated: DDP checks a hook's annotations against dist.GradBucket
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            sent["bytes"] += buf.numel() * buf.element_size()
            sent["calls"] += 1
            fut = torch.distributed.all_reduce(buf, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / world)

        ddp.register_comm_hook(None, hook)  # type: ignore[operator]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    def mexc_step(i: int) -> None:
        x, y = batches[i]
        prog.step(shard_rows(x, rank, world), shard_rows(y, rank, world))

    def fp32_step(i: int) -> None:
        x, y = batches[i]
        xs = torch.from_numpy(shard_rows(x, rank, world))
        ys = torch.from_numpy(shard_rows(y, rank, world).astype(np.int64))
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(xs), ys).backward()
        opt.step()

    before = (comm.bytes_sent, comm.calls) if comm else (0, 0)
    for i in range(2):  # warm-up; mexc's collectives counted over these two steps
        mexc_step(i)
        fp32_step(i)
    after = (comm.bytes_sent, comm.calls) if comm else (0, 0)
    sent["bytes"] = sent["calls"] = 0
    times: dict[str, list[float]] = {"mexc": [], "fp32": []}
    i = 2
    for _ in range(args.blocks):
        for label, fn in (("mexc", mexc_step), ("fp32", fp32_step)):
            time.sleep(SETTLE_S)
            if world > 1:
                torch.distributed.barrier()
            t = time.perf_counter()
            for k in range(args.block_steps):
                fn(i + k)
            times[label].append((time.perf_counter() - t) / args.block_steps)
        i += args.block_steps
    timed = args.blocks * args.block_steps
    return {
        "mexc_s_per_step": statistics.median(times["mexc"]),
        "fp32_ddp_s_per_step": statistics.median(times["fp32"]),
        "mexc_bytes_per_step": (after[0] - before[0]) // 2,
        "mexc_collectives_per_step": (after[1] - before[1]) // 2,
        "fp32_ddp_bytes_per_step": sent["bytes"] // timed,
        "fp32_ddp_collectives_per_step": sent["calls"] // timed,
        "checksum": prog.state_checksum(),
        "target": prog.options.target,
        "params": sum(p.numel() for p in fp32.parameters()),
    }


def worker(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = init_from_env().rank if world > 1 else 0
    torch.set_num_threads(1)  # W workers share the cores: one thread each
    out = {name: measure(name, args, world, rank) for name in args.models.split(",")}
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="FashionCNN,MLP,ViTTiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--target", default="auto", choices=("auto", "reference", "llvm"))
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "distributed.json"))
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    rows: dict[int, dict[str, Any]] = {}
    for w in (int(v) for v in args.workers.split(",")):
        with tempfile.TemporaryDirectory() as d:
            part = Path(d, "rank0.json")
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker-out", str(part)]
            env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            # the workers share the cores: TVM's pool of each llvm step gets its share
            env["TVM_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // w))
            if w == 1:
                code = os.spawnve(os.P_WAIT, sys.executable, cmd, env)
                codes = [code]
            else:
                codes = launch(cmd, w, env=env)
            if any(codes):
                raise SystemExit(f"workers failed at W = {w}: exit codes {codes}")
            rows[w] = json.loads(part.read_text())
    first = rows[min(rows)]
    for w, r in rows.items():
        for name in r:
            if r[name]["checksum"] != first[name]["checksum"]:
                raise SystemExit(f"{name}: the state at W = {w} differs from W = {min(rows)}")
    header = (
        f"{'model':<12} {'target':<9} {'W':>2} {'mexc s/step':>12} {'DDP s/step':>11} {'ratio':>6} "
        f"{'mexc B/step':>12} {'calls':>6} {'DDP B/step':>11} {'calls':>6}"
    )
    print(header)
    for w, r in rows.items():
        for name, v in r.items():
            ratio = v["mexc_s_per_step"] / v["fp32_ddp_s_per_step"]
            print(
                f"{name:<12} {v['target']:<9} {w:>2} {v['mexc_s_per_step']:>12.4f} "
                f"{v['fp32_ddp_s_per_step']:>11.4f} {ratio:>6.2f} {v['mexc_bytes_per_step']:>12} "
                f"{v['mexc_collectives_per_step']:>6} {v['fp32_ddp_bytes_per_step']:>11} "
                f"{v['fp32_ddp_collectives_per_step']:>6}"
            )
    doc = {
        "what": __doc__.strip().splitlines()[0],
        "command": " ".join(["python", "bench/distributed.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "batch": args.batch,
        "cpus": len(os.sched_getaffinity(0)),
        "results": {str(w): r for w, r in rows.items()},
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
