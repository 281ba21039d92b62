"""GPU check of ahead-of-time compiled training steps (bench/gpu_check.sh runs it).

    python -m mexc.backends.cuda.check [--time-steps N] ARTIFACT_DIR [ARTIFACT_DIR ...]

Each folder comes from `bench/make_gpu_artifacts.py`: a CUDA artifact (plan.json, cubins,
program.mexc) plus `check.npz` (the batch) and `expected.json` (what the host computed: the loss
and state checksum after every step, and the SHA-256 of every plan buffer after the first step,
from the host twin that runs the same plan's TIR through TVM's llvm target). On the GPU:

- bit-exactness: the same steps on the same batch give the same losses and checksums; when they
  do not, the first buffer (in launch order) whose bytes differ after step 1 names the kernel
  to look at;
- speed (folders whose expected.json names a torch model): the median step time of mexc
  replaying its CUDA graph and launching kernel by kernel, of PyTorch FP32 eager and of
  PyTorch BF16 autocast (same model, batch, SGD with momentum), and the time of every kernel
  alone (the ten slowest are reported).

Needs CuPy and a GPU, not TVM or nvcc. Prints a table; writes cuda_check.json to $OUT when set;
exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mexc.backends.cuda.program import load_cuda
from mexc.backends.cuda.roofline import GPUS, estimate, kernel_costs

ROOFLINE_GPU = {"sm_80": "A100", "sm_90": "H200"}  # the GPUs of docs/cuda.md's estimate


def first_difference(got: dict[str, str], want: dict[str, str], kernels: list) -> str | None:
    """The first buffer, in the order the kernels write it, whose digest differs."""
    order: list[str] = []
    for *_, args in kernels:
        order += [a for a in args if a not in order]
    order += [n for n in want if n not in order]
    for name in order:
        if name in want and got.get(name) != want[name]:
            return name
    return None


def against_roofline(
    plan: dict[str, Any], kernel_s: dict[str, float], gpu: str
) -> dict[str, dict[str, float]]:
    """Measured milliseconds per kernel group (`kernel_s`: kernel_times, keyed "<index>
    <symbol>") beside the roofline estimate's for `gpu` (a key of roofline.GPUS): the plain
    roofline and the one capped by each launch's parallelism."""
    costs = kernel_costs(plan)
    est = estimate(costs, GPUS[gpu], gemm=plan.get("gemm", "imma"))
    out: dict[str, dict[str, float]] = {}
    measured = {int(key.split()[0]): s for key, s in kernel_s.items()}
    for c in costs:
        row = out.setdefault(c.group, {"measured_ms": 0.0, "roofline_ms": 0.0, "capped_ms": 0.0})
        row["measured_ms"] += measured.get(c.index, 0.0) * 1e3
        row["roofline_ms"] += est.peak_s[c.index] * 1e3
        row["capped_ms"] += est.kernel_s[c.index] * 1e3
    return out


def check_exact(folder: Path) -> dict[str, Any]:
    expected = json.loads((folder / "expected.json").read_text())
    batch = np.load(folder / "check.npz")
    x, y = batch["x"], batch["y"]
    prog = load_cuda(folder)
    row: dict[str, Any] = {"artifact": folder.name, "arch": prog.arch, "exact": True}
    # buffer by buffer, one step with an allocation per buffer (the twin's expected digests
    # come from the same layout; in the arena, buffers share bytes)
    diag = load_cuda(folder, layout="separate")
    diag.step(x, y)
    bad = first_difference(diag.buffer_digests(), expected["buffers"], diag.plan["kernels"])
    row["first_differing_buffer"] = bad
    del diag
    for step, (loss, checksum) in enumerate(zip(expected["losses"], expected["checksums"])):
        got = prog.step(x, y)
        if got != loss or prog.state_checksum() != checksum:
            row.update(exact=False, failed_step=step, loss=got, want_loss=loss)
            break
    row["steps"] = len(expected["losses"])
    if row["exact"] and "predictions" in expected:  # the inference artifact (predict)
        got_ids = prog.predict(x).tolist()
        row["predict_on_gpu"] = prog._inference_plan() is not None
        if got_ids != expected["predictions"]:
            row.update(exact=False, failed="predict")
    return row


# alternated_medians: steps per block, and the pause before each block
BLOCK_STEPS = 5
BLOCK_PAUSE_S = 0.05


def alternated_medians(
    runs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
    steps: int,
    block: int = BLOCK_STEPS,
    pause_s: float = BLOCK_PAUSE_S,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds per step of each contender (name -> (run one step, synchronize)), timed
    in alternating blocks of `block` steps (A B C A B C ...) with a pause before each block,
    until each has `steps` steps: a clock or a neighbour's load that drifts during the run
    weighs on every contender alike (bench/README.md), where timing one after the other gave
    PyTorch FP32 8.3-11.3 ms over three runs of one day (docs/cuda.md)."""
    for run, sync in runs.values():
        for _ in range(warmup):
            run()
        sync()
    times: dict[str, list[float]] = {name: [] for name in runs}
    while min(len(t) for t in times.values()) < steps:
        for name, (run, sync) in runs.items():
            time.sleep(pause_s)
            for _ in range(block):
                t0 = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[:steps]) for name, t in times.items()}


def _torch_contender(spec: dict[str, Any], bf16: bool) -> tuple[Callable[[], None], int]:
    """One PyTorch training step of the artifact's model (SGD with momentum; BF16 autocast or
    FP32 eager), and the peak bytes it allocated on the device over three steps beyond what
    was allocated before (model, optimizer state, activations and gradients)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    module, name = spec["model"].split(":")
    model = getattr(importlib.import_module(module), name)().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shape = (spec["batch"], *spec["input_shape"])
    vocab = int(spec.get("vocab", 0))  # token ids, or floats
    if vocab:
        x = torch.randint(0, vocab, shape, device="cuda")
    else:
        x = torch.randn(*shape, device="cuda")
    labels = (spec["batch"], *spec.get("label_shape", ()))
    y = torch.randint(0, int(spec.get("classes", 10)), labels, device="cuda")

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    return run, int(torch.cuda.max_memory_allocated() - before)


def time_step(folder: Path, steps: int) -> dict[str, Any]:
    """Median step times: mexc cuda (CUDA graph), PyTorch FP32 eager and PyTorch BF16 autocast
    in alternating blocks (alternated_medians); then mexc launched kernel by kernel, and each
    kernel alone."""
    import gc

    from mexc.backends.cuda.runtime import cupy_module

    spec = json.loads((folder / "expected.json").read_text())["timing"]
    gc.collect()  # the earlier folders' programs: their blocks out of CuPy's pool
    pool = cupy_module().get_default_memory_pool()
    pool.free_all_blocks()
    prog = load_cuda(folder)
    rng = np.random.default_rng(0)
    x, y = prog.random_batch(rng)
    for _ in range(2):  # the first step launches one by one, the second captures the graph
        prog.step(x, y)
    prog.synchronize()
    pool_bytes = int(pool.total_bytes())  # before torch's contenders share the device
    fp32_run, fp32_peak = _torch_contender(spec, bf16=False)
    bf16_run, bf16_peak = _torch_contender(spec, bf16=True)
    import torch

    # the three contenders in alternating blocks (alternated_medians)
    medians = alternated_medians(
        {
            "mexc": (lambda: prog.step(x, y), prog.synchronize),
            "fp32": (fp32_run, torch.cuda.synchronize),
            "bf16": (bf16_run, torch.cuda.synchronize),
        },
        steps,
    )
    mexc_s, fp32, bf16 = medians["mexc"], medians["fp32"], medians["bf16"]
    graph = prog.use_graph  # False where capture failed
    prog.set_graph(False)
    one_by_one = {"mexc": (lambda: prog.step(x, y), prog.synchronize)}
    launches_s = alternated_medians(one_by_one, steps, block=steps, pause_s=0.0)["mexc"]
    kernels = prog.kernel_times(x, y, repeats=2)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    launches = len(prog.plan["kernels"])
    device_bytes = prog.allocated_bytes()["device"]
    return {
        "artifact": folder.name,
        "arch": prog.arch,
        "batch": prog.batch,
        "mexc_cuda_s": mexc_s,
        # how mexc, FP32 and BF16 were timed: alternating blocks (alternated_medians)
        "timing": {"block_steps": BLOCK_STEPS, "pause_s": BLOCK_PAUSE_S, "steps": steps},
        "cuda_graph": graph,
        "mexc_cuda_no_graph_s": launches_s,
        "launches": launches,
        # what the graph saves per kernel launch (host launch cost not hidden by the device)
        "graph_saving_per_launch_us": (launches_s - mexc_s) / launches * 1e6,
        "torch_fp32_s": fp32,
        "torch_bf16_s": bf16,
        "mexc_over_fp32": mexc_s / fp32,
        "mexc_over_bf16": mexc_s / bf16,
        # device memory: what the program allocated (state region + arena), the whole CuPy
        # pool (those plus batch staging), and torch's peak for one FP32 / BF16 training step
        "mexc_device_bytes": device_bytes,
        "cupy_pool_bytes": pool_bytes,
        "torch_fp32_peak_bytes": fp32_peak,
        "torch_bf16_peak_bytes": bf16_peak,
        "mexc_over_fp32_memory": pool_bytes / fp32_peak,
        "kernel_sum_s": sum(kernels.values()),
        # the roofline estimate of the GPU the artifact's cubin is for (docs/cuda.md)
        "kernel_groups": against_roofline(prog.plan, kernels, ROOFLINE_GPU[prog.arch]),
        "slowest_kernels_s": dict(top),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU check of mexc CUDA artifacts")
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--time-steps", type=int, default=20, help="steps per timing median")
    args = ap.parse_args(argv)
    exact: list[dict[str, Any]] = []
    timing: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    for folder in args.folders:
        # one folder's failure (a launch error, an old CuPy) must not hide the others' results
        try:
            _check_folder(folder, args.time_steps, exact, timing)
        except Exception as err:  # noqa: BLE001 - reported in the JSON, the run goes on
            import traceback

            traceback.print_exc()
            errors.append({"artifact": folder.name, "error": f"{type(err).__name__}: {err}"})
        _write_report(exact, timing, errors)
    inexact = sum(not r["exact"] for r in exact)
    print(f"{len(exact) - inexact}/{len(exact)} artifacts bit-exact")
    if errors:
        print(f"{len(errors)} folder(s) failed: {errors}")
    return 1 if inexact or errors else 0


def _write_report(exact: list, timing: list, errors: list) -> None:
    """cuda_check.json in $OUT, rewritten after every folder (a later crash keeps the rest)."""
    if os.environ.get("OUT"):
        doc = {"exact": exact, "timing": timing, "errors": errors}
        Path(os.environ["OUT"], "cuda_check.json").write_text(json.dumps(doc, indent=1))


def _check_folder(folder: Path, time_steps: int, exact: list, timing: list) -> None:
    """Check one artifact folder: bit-exactness, then timing where expected.json asks."""
    spec = json.loads((folder / "expected.json").read_text())
    if spec.get("losses"):
        exact.append(check_exact(folder))
        r = exact[-1]
        status = "ok " if r["exact"] else "BAD"
        print(f"{r['artifact']:24s} {r['arch']} {status} {r['steps']} steps", end="")
        print(f"  first differing buffer: {r['first_differing_buffer']}")
    if spec.get("timing"):
        timing.append(time_step(folder, time_steps))
        t = timing[-1]
        print(
            f"{t['artifact']:24s} batch {t['batch']}: mexc {1e3 * t['mexc_cuda_s']:.2f} ms "
            f"(graph {t['cuda_graph']}; launch by launch "
            f"{1e3 * t['mexc_cuda_no_graph_s']:.2f} ms, {t['launches']} launches), "
            f"FP32 {1e3 * t['torch_fp32_s']:.2f} ms, BF16 {1e3 * t['torch_bf16_s']:.2f} ms, "
            f"mexc/FP32 {t['mexc_over_fp32']:.2f}, mexc/BF16 {t['mexc_over_bf16']:.2f}"
        )
        print(
            f"  device memory: mexc {t['mexc_device_bytes'] / 2**20:.1f} MiB allocated, "
            f"CuPy pool {t['cupy_pool_bytes'] / 2**20:.1f} MiB; torch peak FP32 "
            f"{t['torch_fp32_peak_bytes'] / 2**20:.1f} MiB, BF16 "
            f"{t['torch_bf16_peak_bytes'] / 2**20:.1f} MiB; pool/FP32 "
            f"{t['mexc_over_fp32_memory']:.3f}"
        )
        print(f"  {'kernel group':28s} measured ms  roofline ms  capped ms")
        for group, g in sorted(t["kernel_groups"].items(), key=lambda kv: -kv[1]["measured_ms"]):
            print(
                f"  {group:28s} {g['measured_ms']:11.3f}  {g['roofline_ms']:11.3f}  "
                f"{g['capped_ms']:9.3f}"
            )


if __name__ == "__main__":
    sys.exit(main())
