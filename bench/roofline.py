"""Roofline estimate of the CUDA training step, kernel by kernel, for A100 and H200 (no GPU).

    python bench/roofline.py                  # ResNet-18 (3x32x32) and FashionCNN, batch 128
    python bench/roofline.py --models ResNet18 --pack-budget 268435456  # fewer batch chunks
    python bench/roofline.py --artifact build/gpu/resnet18-b128   # a built artifact's plan.json

Lowers each model's step with TVM to the launch list the artifact would have
(`mexc.backends.cuda.build.lower_step`: no nvcc), or reads an artifact's plan.json, and prices
every kernel with `mexc.backends.cuda.roofline` (bytes of its arguments, integer operations, the
parallelism of its launch; datasheet peaks). Prints the step's predicted time with and without
a CUDA graph, the time per kernel group and the slowest kernel families, beside the host's own
share of a step measured here (quantizing the batch, the stream keys) and, for ResNet-18, a
PyTorch figure scaled from NVIDIA's published ResNet-50 training throughput on an A100.
Writes bench/results/roofline.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mexc.backends.cuda.roofline import (  # noqa: E402
    GPUS,
    Estimate,
    KernelCost,
    Model,
    estimate,
    kernel_costs,
)
from mexc.kernels.quantize import quantize  # noqa: E402
from mexc.numerics import stream_keys  # noqa: E402
from mexc.trainer import provenance, write_json_atomic  # noqa: E402

MODELS = {  # name: (module:class, input shape)
    "ResNet18": ("examples.resnet:ResNet18", (3, 32, 32)),
    "FashionCNN": ("examples.models:FashionCNN", (1, 28, 28)),
}

# NVIDIA Deep Learning Examples, PyTorch ResNet50 v1.5 README, "Training performance: NVIDIA
# DGX A100 (8x A100 80GB)", 1 GPU, pytorch-21.03 NGC container, 224x224 ImageNet
R50_A100_IMG_S = {"tf32": 938.0, "mixed": 2470.0}
R50_SOURCE = (
    "github.com/NVIDIA/DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/"
    "README.md, Training performance: NVIDIA DGX A100 (8x A100 80GB), 1 GPU"
)


def resnet50_macs(size: int = 224) -> int:
    """Multiply-accumulates of one ResNet-50 v1.5 forward pass (convolutions and the
    classifier; stride on the 3x3 convolution of each first bottleneck), at `size` x `size`."""
    hw = size // 2
    macs = 3 * 64 * 49 * hw * hw  # 7x7 stem, stride 2
    hw //= 2  # max pool
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            s = stride if b == 0 else 1
            out_hw = hw // s
            macs += cin * width * hw * hw  # 1x1 reduce
            macs += width * width * 9 * out_hw * out_hw  # 3x3
            macs += width * 4 * width * out_hw * out_hw  # 1x1 expand
            if b == 0:
                macs += cin * 4 * width * out_hw * out_hw  # projection shortcut
            cin, hw = 4 * width, out_hw
    return macs + 2048 * 1000


def torch_macs(model: Any, shape: tuple[int, ...]) -> int:
    """Forward multiply-accumulates per sample of a torch model's convolutions and linears."""
    import torch

    total = [0]

    def count(mod: Any, _: Any, out: Any) -> None:
        if isinstance(mod, torch.nn.Conv2d):
            k = mod.in_channels // mod.groups * mod.kernel_size[0] * mod.kernel_size[1]
            total[0] += out[0].numel() * k
        elif isinstance(mod, torch.nn.Linear):
            total[0] += out[0].numel() * mod.in_features

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    with torch.no_grad():
        model(torch.zeros(1, *shape))
    for h in hooks:
        h.remove()
    return total[0]


def _model_class(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(__import__(module, fromlist=[name]), name)


def lowered_manifest(name: str, batch: int, pack_budget: int | None = None) -> dict[str, Any]:
    """The launch list of `name`'s step as an artifact would hold it (TVM, no nvcc); the
    optimizer of bench/make_gpu_artifacts.py (the artifacts gpu_check.sh times);
    `pack_budget`: build_plan's (bytes of a product's packs before it runs over batch
    chunks)."""
    import torch

    import mexc
    from mexc.backends.cuda.build import lower_step

    spec, shape = MODELS[name]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(100, 5))
    prog = mexc.compile(_model_class(spec)(), (torch.zeros(batch, *shape),), optimizer=opt)
    return lower_step(prog, pack_budget).manifest


def host_seconds(shape: tuple[int, ...], key_count: int, repeats: int = 7) -> float:
    """Best-of time here of the host's work per step before the kernels: quantizing the float
    batch (the float boundary, numpy) and deriving the stream keys."""
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ids = np.arange(key_count, dtype=np.int64)
    best = float("inf")
    for step in range(repeats):
        t0 = time.perf_counter()
        quantize(x, 8)
        stream_keys(0, step, ids)
        best = min(best, time.perf_counter() - t0)
    return best


def _groups(costs: list[KernelCost], est: dict[str, Estimate], key: str) -> list[dict[str, Any]]:
    """Launches, bytes, operations and predicted milliseconds (roofline, capped) per GPU of
    the kernels with equal `key` (group or family), slowest first on the first GPU."""
    rows: dict[str, dict[str, Any]] = {}
    for c in costs:
        row = rows.setdefault(getattr(c, key), {"launches": 0, "mbytes": 0.0, "gops": 0.0})
        row["launches"] += 1
        row["mbytes"] += c.bytes / 1e6
        row["gops"] += c.ops / 1e9
        for g, e in est.items():
            row[f"{g}_peak_ms"] = row.get(f"{g}_peak_ms", 0.0) + e.peak_s[c.index] * 1e3
            row[f"{g}_ms"] = row.get(f"{g}_ms", 0.0) + e.kernel_s[c.index] * 1e3
    out = [{key: k, **{n: round(v, 3) for n, v in r.items()}} for k, r in rows.items()]
    return sorted(out, key=lambda r: -r[f"{next(iter(est))}_ms"])


def measure(name: str, manifest: dict[str, Any], input_shape: tuple[int, ...]) -> dict[str, Any]:
    model = Model()
    costs = kernel_costs(manifest, model)
    gemm = manifest.get("gemm", "imma")
    est = {g: estimate(costs, gpu, model, gemm) for g, gpu in GPUS.items()}
    batch = int(manifest["buffers"][manifest["labels"]][0][0])
    host = host_seconds((batch, *input_shape), len(manifest["key_ids"]))
    per_gpu = {
        g: {
            "roofline_kernels_ms": round(sum(e.peak_s) * 1e3, 3),
            "roofline_graph_ms": round(e.peak_graph_s * 1e3, 3),
            "roofline_no_graph_ms": round(e.peak_no_graph_s * 1e3, 3),
            "capped_kernels_ms": round(sum(e.kernel_s) * 1e3, 3),
            "capped_graph_ms": round(e.graph_s * 1e3, 3),
            "capped_no_graph_ms": round(e.no_graph_s * 1e3, 3),
            "bounds": {b: e.bound.count(b) for b in ("memory", "latency", "compute")},
        }
        for g, e in est.items()
    }
    return {
        "model": name,
        "batch": batch,
        "gemm": gemm,
        "launches": len(costs),
        "gemm_launches": sum(c.gemm for c in costs),
        "mbytes": round(sum(c.bytes for c in costs) / 1e6, 1),
        "device_mib": round(
            (manifest["layout"]["state_bytes"] + manifest["layout"]["arena_bytes"]) / 2**20, 1
        ),
        "gemm_gmacs_padded": round(sum(c.macs for c in costs) / 1e9, 2),
        "host_ms_here": round(host * 1e3, 2),
        "gpus": per_gpu,
        "groups": _groups(costs, est, "group"),
        "families": _groups(costs, est, "family")[:15],
    }


def torch_reference(name: str, batch: int) -> dict[str, Any]:
    """PyTorch on an A100 for `name`, scaled from the published ResNet-50 throughput by
    forward MACs per image: an estimate, and an optimistic one (small images use a GPU less
    well than 224x224 ones)."""
    spec, shape = MODELS[name]
    ratio = resnet50_macs() / torch_macs(_model_class(spec)(), shape)
    out: dict[str, Any] = {"source": R50_SOURCE, "r50_over_model_macs": round(ratio, 2)}
    for prec, img_s in R50_A100_IMG_S.items():
        out[f"a100_{prec}_step_ms_estimate"] = round(batch / (img_s * ratio) * 1e3, 2)
    return out


def _artifact_name(folder: Path) -> str:
    """The MODELS name of a bench/make_gpu_artifacts.py folder's model, else the folder's."""
    expected = folder / "expected.json"
    if expected.is_file():
        spec = json.loads(expected.read_text()).get("model")
        for name, (model, _) in MODELS.items():
            if model == spec:
                return name
    return folder.name


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def report(row: dict[str, Any]) -> None:
    print(
        f"\n{row['model']} batch {row['batch']} ({row['gemm']}): {row['launches']} launches "
        f"({row['gemm_launches']} GEMM), {row['mbytes']} MB touched, "
        f"{row['gemm_gmacs_padded']} GMACs (padded GEMMs), {row['device_mib']} MiB of device "
        f"memory; host here {row['host_ms_here']} ms"
    )
    for g, r in row["gpus"].items():
        print(
            f"  {g}: roofline kernels {r['roofline_kernels_ms']:.2f} ms, step "
            f"{r['roofline_graph_ms']:.2f} (graph) / {r['roofline_no_graph_ms']:.2f} ms; capped "
            f"kernels {r['capped_kernels_ms']:.2f} ms, step {r['capped_graph_ms']:.2f} (graph) / "
            f"{r['capped_no_graph_ms']:.2f} ms; bound {r['bounds']}"
        )
    cols = ["launches", "mbytes", "gops", *(f"{g}{k}" for g in GPUS for k in ("_peak_ms", "_ms"))]
    print(_table(row["groups"], ["group", *cols]))
    print(_table(row["families"][:10], ["family", *cols]))
    if "torch" in row:
        print(f"  PyTorch (estimate): {row['torch']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--artifact", action="append", default=[], help="artifact folder(s)")
    ap.add_argument(
        "--pack-budget", type=int, default=None, help="bytes (mexc compile --pack-budget)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "roofline.json"))
    args = ap.parse_args(argv)
    rows = []
    sources: list[tuple[str, dict[str, Any], tuple[int, ...]]] = []
    for folder in args.artifact:
        man = json.loads((Path(folder) / "plan.json").read_text())
        x = man["input"][0]
        shape = tuple(man["buffers"][x][0] if x in man["buffers"] else man["views"][x][1])[1:]
        sources.append((_artifact_name(Path(folder)), man, shape))
    if not args.artifact:
        for name in args.models.split(","):
            man = lowered_manifest(name, args.batch, args.pack_budget)
            sources.append((name, man, MODELS[name][1]))
    for name, man, shape in sources:
        row = measure(name, man, shape)
        row["pack_budget"] = None if args.artifact else args.pack_budget  # None: the default
        if name == "ResNet18":
            row["torch"] = torch_reference(name, row["batch"])
        report(row)
        rows.append(row)
    model = Model()
    write_json_atomic(
        args.out,
        {
            **provenance("mexc-bench-roofline-1", ["python", *sys.argv]),
            "gpus": {g: vars(gpu) for g, gpu in GPUS.items()},
            "model": vars(model),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
