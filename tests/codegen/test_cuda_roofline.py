"""The roofline estimate of a CUDA step (mexc.backends.cuda.roofline, bench/roofline.py): each
kernel's bytes, operations and bound on a hand-made plan, the step's launch gaps with and without
a CUDA graph, and on a real lowered step, that the GEMM extents read from the operands' shapes
agree with the launch extents TVM chose."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mexc
from examples.models import EXAMPLES
from mexc.backends.cuda.roofline import (
    A100,
    H200,
    Model,
    estimate,
    family_of,
    group_of,
    kernel_costs,
    kernel_time,
    step_time,
)

MODEL = Model()


def _plan() -> dict:
    """A GEMM (C = A·Bᵀ, 1×128×64 by 64×64 over K = 64), a one-block max |x| over 1 MiB of
    int8, an elementwise rounding apply over 2^24 int32 accumulators (a view) into int8."""
    return {
        "buffers": {
            "a": [[1, 128, 64], "int8"],
            "b": [[1, 64, 64], "int8"],
            "c": [[1, 128, 64], "int32"],
            "w": [[1024, 1024], "int8"],
            "amax": [[1], "int32"],
            "acc": [[2, 1 << 24], "int32"],
            "out": [[1 << 24], "int8"],
            "key": [[1], "int64"],
        },
        "views": {"acc@1": ["acc", [1 << 24], 1 << 24]},
        "gemm_kernels": ["n1_fwd_gemm_kernel"],
        "kernels": [
            [0, "n1_fwd_gemm_kernel", [1, 2, 1], [32, 2, 2], ["a", "b", "c"]],
            [0, "n7_sgd_w_rescale_kernel", [1, 1, 1], [128, 1, 1], ["w", "amax", "w"]],
            [0, "n9_c0_apply_kernel_2", [65536, 1, 1], [256, 1, 1], ["acc@1", "key", "out"]],
        ],
    }


def test_kernel_costs_of_a_hand_made_plan() -> None:
    gemm, reduction, apply = kernel_costs(_plan())
    assert (gemm.kind, gemm.macs, gemm.ops) == ("gemm", 128 * 64 * 64, 2 * 128 * 64 * 64)
    assert gemm.bytes == 128 * 64 + 64 * 64 + 4 * 128 * 64 and gemm.blocks == 2
    # an argument named twice is touched once; one block of threads looping: a reduction
    assert (reduction.kind, reduction.bytes, reduction.threads) == ("reduction", (1 << 20) + 4, 128)
    assert reduction.ops == 4 * (1 << 20) and reduction.itemsize == 1
    assert (apply.kind, apply.family, apply.itemsize) == ("rounding", "c0_apply", 4)
    assert apply.bytes == 4 * (1 << 24) + 8 + (1 << 24) and apply.ops == 40 * (1 << 24)


def test_kernel_time_bounds() -> None:
    gemm, reduction, apply = kernel_costs(_plan())
    # plain roofline: bytes / bandwidth or operations / peak, whichever is larger
    t, bound = kernel_time(apply, A100, capped=False)
    assert bound == "memory" and t == pytest.approx(apply.bytes / 2.039e12)
    t, bound = kernel_time(apply, H200, capped=False)
    assert bound == "compute" and t == pytest.approx(apply.ops / 33.5e12)
    # capped: one block of 128 threads with four 1-byte loads in flight each, 2048 round trips
    t, bound = kernel_time(reduction, A100)
    assert bound == "latency"
    assert t == pytest.approx(600e-9 * reduction.bytes / (128 * 4))
    # the GEMM's two blocks of 128 threads stage 32 bytes each per round trip
    t, bound = kernel_time(gemm, A100)
    assert (t, bound) == (pytest.approx(600e-9 * gemm.bytes / (256 * 32)), "latency")
    # with (almost) nothing to move: the INT8 tensor-core peak, or dp4a's four MACs per lane
    compute_only = replace(gemm, bytes=1)
    assert kernel_time(compute_only, A100, capped=False) == (
        pytest.approx(gemm.ops / 624e12),
        "compute",
    )
    assert kernel_time(compute_only, A100, gemm="dp4a", capped=False)[0] == pytest.approx(
        gemm.ops / (4 * 19.5e12)
    )
    # the rounding apply fills the GPU, yet 5 bytes per thread in flight do not cover the
    # H200's bandwidth-latency product (4.8 TB/s * 600 ns = 2.9 MB for 270k threads)
    t, bound = kernel_time(apply, H200)
    in_flight = 132 * 2048 * apply.bytes / apply.threads
    assert bound == "latency" and t == pytest.approx(600e-9 * apply.bytes / in_flight)
    assert t > kernel_time(apply, H200, capped=False)[0]


def test_step_time_with_and_without_a_graph() -> None:
    short, long = [0.2e-6] * 10, [0.2e-6, 50e-6, *([0.2e-6] * 8)]
    # a graph: back to back, 1 us apart
    assert step_time(short, MODEL, graph=True) == pytest.approx(10 * 1.2e-6)
    # one by one: the host issues a launch every 5 us, the device waits for it
    assert step_time(short, MODEL, graph=False) == pytest.approx(50e-6 + 0.2e-6)
    # a long kernel (the second, issued at 10 us) hides the launches queued behind it
    t = step_time(long, MODEL, graph=False)
    assert t == pytest.approx(10e-6 + 50e-6 + 8 * 1.2e-6)  # issued at 10 us, then 1 us apart
    assert t < 10 * 5e-6 + 50e-6


def test_families_and_groups() -> None:
    assert family_of("n36_dg16_shift_kernel_3") == "dg16_shift"
    assert family_of("n4_fwd_pack_b_k0_kernel") == "fwd_pack_b"
    assert family_of("n351_sgd_w_target_kernel_1") == "sgd_w_target"
    assert [group_of(f) for f in ("dw_gemm", "dx_pack_a", "fwd_unpack", "sgd_v_sum")] == [
        "gemm",
        "pack (im2col, transposes)",
        "unpack",
        "sgd update",
    ]
    assert group_of("c0_shift") == "compaction shift (max abs)"
    assert group_of("bn_stats") == "batch-norm statistics"
    assert group_of("relu") == "elementwise, pooling, head"


def test_gemm_extents_agree_with_tvm_launches() -> None:
    """On the lowered DigitsCNN step (TVM, no nvcc; batch 8 over chunks of 2): every GEMM's
    C, read from its operands' shapes, is the 64×64 tiles TVM launched one block each, the
    padded MACs cover the products' own, and every kernel gets a positive cost and time."""
    pytest.importorskip("tvm")
    from mexc.backends.cuda.build import lower_step
    from mexc.backends.cuda.products_build import product_forms

    cls, shape = EXAMPLES["DigitsCNN"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(8, *shape),))
    man = lower_step(prog, pack_budget=2048).manifest
    costs = kernel_costs(man)
    gemms = [c for c in costs if c.gemm]
    assert (
        len(gemms) == len([k for k in man["kernels"] if k[1] in set(man["gemm_kernels"])])
        and len(gemms) > 0
    )
    shapes = {**{k: v[0] for k, v in man["buffers"].items()}}
    for c in gemms:
        args = man["kernels"][c.index][4]
        k = next(shapes[a][2] for a in args if a in shapes and man["buffers"][a][1] == "int8")
        assert c.macs == c.blocks * 64 * 64 * k
    assert sum(c.macs for c in gemms) >= sum(u.form.macs for u in product_forms(prog))
    assert all(c.bytes > 0 and c.ops > 0 and c.threads > 0 for c in costs)
    est = estimate(costs, A100)
    assert all(t > 0 for t in est.kernel_s)
    assert all(p <= t for p, t in zip(est.peak_s, est.kernel_s))
    assert est.peak_graph_s <= est.graph_s and est.graph_s < est.no_graph_s
