"""The launch-plan layout: one state region and one lifetime-planned arena
(mexc.backends.plan_layout),
the allocator behind it (mexc.arena), and what the llvm backend really allocates."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import mexc
from examples.models import DigitsCNN
from mexc import arena
from mexc.arena import overlaps, place
from mexc.backends.plan_layout import check_layout, lifetimes, plan_layout, separate_bytes

I32 = "int32"


def _manifest() -> dict:
    """Five int32[16] buffers (64 bytes each): the state `w`, the host input `x`, and a, b, c
    live over launches 0-1, 1-2 and 2-3 (a and c may share bytes, b may not)."""
    bufs = {k: [[16], I32] for k in ("w", "x", "a", "b", "c")}
    return {
        "buffers": bufs,
        "views": {"a@4x4": ["a", [4, 4], 0]},
        "constants": {},
        "state": {"w": ["w", "w"]},
        "input": ["x", "x"],
        "keys": "",
        "labels": "",
        "valid": "",
        "lr": "",
        "loss_rows": "",
    }


LAUNCHES = [["x", "a@4x4"], ["a", "b"], ["b", "c"], ["c", "w"]]


def test_disjoint_lifetimes_share_bytes_and_the_state_is_apart() -> None:
    man = _manifest()
    assert lifetimes(man, LAUNCHES)["a"] == (0, 1)  # through its view
    layout = plan_layout(man, LAUNCHES)
    off = layout["offsets"]
    assert off["w"][0] == off["x"][0] == "state" and layout["state_bytes"] == 128
    assert off["a"] == off["c"] and off["a"][0] == "arena"
    assert off["b"][1] != off["a"][1] and layout["arena_bytes"] == 128
    man["layout"] = layout
    check_layout(man, LAUNCHES)


def test_a_layout_that_overlaps_live_buffers_is_refused() -> None:
    man = _manifest()
    man["layout"] = plan_layout(man, LAUNCHES)
    man["layout"]["offsets"]["b"] = list(man["layout"]["offsets"]["a"])
    with pytest.raises(ValueError, match="live together"):
        check_layout(man, LAUNCHES)
    man["layout"] = plan_layout(man, LAUNCHES)
    man["layout"]["offsets"]["c"] = ["arena", 4096]
    with pytest.raises(ValueError, match="does not fit"):
        check_layout(man, LAUNCHES)


def test_place_never_overlaps_live_items_and_reaches_the_live_peak() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        items = []
        for k in range(int(rng.integers(1, 60))):
            a = int(rng.integers(0, 40))
            items.append((a, a + int(rng.integers(0, 10)), int(rng.integers(1, 500)), k))
        offsets, peak = place(items, 16)
        assert not overlaps(items, offsets)
        assert all(offsets[k] % 16 == 0 and offsets[k] + z <= peak for _, _, z, k in items)
        live = max(sum(z for a, b, z, _ in items if a <= t <= b) for t in range(50))
        assert live <= peak


def test_place_refines_a_fragmented_placement_down_to_the_live_peak() -> None:
    # every fixed order with first or best fit leaves a 16-byte hole here (peak 160)
    items = [(2, 5, 64, 0), (7, 8, 48, 1), (4, 7, 48, 2), (7, 7, 48, 3), (1, 4, 16, 4)]
    fixed = [
        arena._place(sorted(items, key=k), b, 16)[1] for k in arena.ORDERS.values() for b in (0, 1)
    ]
    assert min(fixed) == 160
    offsets, peak = place(items, 16)
    assert peak == arena.live_peak(items, 16) == 144
    assert not overlaps(items, offsets)


def test_llvm_allocates_the_layout_and_trains_in_it_bit_exact() -> None:
    """The llvm program's buffers are windows into the two regions of its layout (a fraction
    of one allocation per buffer), and it trains bit-exact with the reference in them."""
    torch.manual_seed(0)
    model = DigitsCNN()
    x = np.random.default_rng(1).standard_normal((32, 1, 8, 8)).astype(np.float32)
    y = np.arange(32) % 10
    ref = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),), target="reference")
    llvm = mexc.compile(model, (torch.from_numpy(x),), target="llvm")
    man = llvm.plan
    layout = man["layout"]
    check_layout(man, [args for _, args in man["launches"]])
    report = llvm.memory_report()
    assert report["backend"] == "llvm"
    assert report["allocated_bytes"] == layout["state_bytes"] + layout["arena_bytes"]
    assert 3 * report["allocated_bytes"] < separate_bytes(man)
    assert report["formula_int_bytes"] > 0 and report["planned_arena_bytes"] > 0
    for _ in range(3):
        assert llvm.step(x, y) == ref.step(x, y)
        assert llvm.state_checksum() == ref.state_checksum()
    assert ref.memory_report()["allocated_bytes"] > report["planned_persistent_bytes"]
    # predict compiles the inference plan: its own bytes (its input buffer at least) are
    # reported apart from the training step's, which do not change
    assert report["allocated_eval_bytes"] == 0
    assert llvm.predict(x).shape == (32,)
    after = llvm.memory_report()
    assert after["allocated_bytes"] == report["allocated_bytes"]
    assert after["allocated_eval_bytes"] >= 32 * 64


def test_the_reference_reports_its_live_values_after_a_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 1, 8, 8)
    prog = mexc.compile(DigitsCNN(), (x,))
    assert prog.memory_report()["allocated_bytes"] == 0  # nothing held before a step
    prog.step(x, torch.arange(16) % 10)
    got = prog.memory_report()
    assert got["allocated_host_bytes"] > got["planned_persistent_bytes"]


def _trains_like_reference(model: torch.nn.Module, batch: int, shape: tuple, **kw) -> None:
    """The llvm program LlvmProgram(**kw) of `model` trains 3 steps as the reference does."""
    from mexc.backends.llvm.step import LlvmProgram

    x = np.random.default_rng(2).standard_normal((batch, *shape)).astype(np.float32)
    y = np.arange(batch) % 10
    ref = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),))
    prog = LlvmProgram(mexc.compile(model, (torch.from_numpy(x),)).retargeted("llvm"), **kw)
    for step in range(3):
        assert prog.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert prog.state_checksum() == ref.state_checksum(), f"state differs after step {step}"


@pytest.mark.parametrize("plan_device", ["cpu", "gpu"])
def test_products_in_batch_chunks_train_bit_exact(plan_device: str) -> None:
    """With a pack budget of 4 KiB every convolution (forward, input and weight gradient) runs
    over chunks of the batch, on the host plan and on the GPU plan (run on the host)."""
    from mexc.lowering.step_plan import build_plan

    torch.manual_seed(0)
    model = DigitsCNN()
    prog = mexc.compile(copy.deepcopy(model), (torch.zeros(12, 1, 8, 8),))
    plan = build_plan(prog, device=plan_device, pack_budget=4096)
    chunked = {launch.symbol.split("_k")[0] for launch in plan.launches if "_k1" in launch.symbol}
    assert any("_fwd" in s for s in chunked) and any("_dw" in s for s in chunked)
    assert any("_dx" in s for s in chunked)
    _trains_like_reference(model, 12, (1, 8, 8), plan_device=plan_device, pack_budget=4096)


def test_gpu_packs_grow_into_the_room_below_the_peak_and_train_bit_exact() -> None:
    """Device.packs_within_peak (step_plan.widen_packs): with a 4 KiB budget, the GPU plan's
    products that the budget chunks take larger chunks where their launches leave room below
    the step's peak: fewer launches, the peak (live bytes) unchanged, and the same bits as the
    reference. A budget the caller passes is every product's."""
    from mexc.lowering.devices import GPU
    from mexc.lowering.step_plan import build_plan, plan_peak

    torch.manual_seed(0)
    model = DigitsCNN()
    prog = mexc.compile(copy.deepcopy(model), (torch.zeros(12, 1, 8, 8),))
    wide = dataclasses.replace(GPU, pack_budget=4096)
    fixed = dataclasses.replace(wide, packs_within_peak=False)
    grown, chunked = build_plan(prog, device=wide), build_plan(prog, device=fixed)
    assert len(grown.launches) < len(chunked.launches)
    assert plan_peak(grown)[0] <= plan_peak(chunked)[0]
    passed = build_plan(prog, device=wide, pack_budget=4096)
    assert [x.symbol for x in passed.launches] == [x.symbol for x in chunked.launches]
    _trains_like_reference(model, 12, (1, 8, 8), plan_device=wide)


class WideReductions(torch.nn.Module):
    """Weight-gradient and batch-norm reductions over 64 * 48 * 48 = 147456 > 2^17 terms:
    int8 x int8 products that need an operand pre-shift (product cap -1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(2)
        self.fc = torch.nn.Linear(2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("plan_device", ["cpu", "gpu"])
def test_reductions_that_need_a_pre_shift_train_bit_exact(plan_device: str) -> None:
    from mexc.lowering.step_plan import build_plan

    torch.manual_seed(0)
    model = WideReductions()
    prog = mexc.compile(copy.deepcopy(model), (torch.zeros(64, 1, 48, 48),))
    symbols = [launch.symbol for launch in build_plan(prog, device=plan_device).launches]
    assert any(s.endswith("_pre3") for s in symbols) and any(s.endswith("_pre7") for s in symbols)
    _trains_like_reference(model, 64, (1, 48, 48), plan_device=plan_device)


def test_buffer_digests_cover_the_state_in_the_arena_and_every_buffer_when_separate() -> None:
    """Arena bytes are shared, so an arena program digests its state region only; a program
    with an allocation per buffer (the diagnosis layout) digests every buffer, and trains the
    same bits."""
    from mexc.backends.llvm.step import LlvmProgram

    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = np.arange(8) % 10
    base = mexc.compile(DigitsCNN(), (torch.from_numpy(x),))
    arena = LlvmProgram(base.retargeted("llvm"))
    separate = LlvmProgram(base.retargeted("llvm"), layout="separate")
    assert arena.step(x, y) == separate.step(x, y)
    assert arena.state_checksum() == separate.state_checksum()
    a, s = arena.buffer_digests(), separate.buffer_digests()
    offsets = arena.plan["layout"]["offsets"]
    assert set(a) == {k for k in s if offsets[k][0] == "state"} and len(s) > 3 * len(a)
    assert all(s[k] == v for k, v in a.items())
    assert separate.allocated_bytes()["host"] > 3 * arena.allocated_bytes()["host"]


def _workspace_and_peak(make: Any, shape: tuple[int, ...], batch: int) -> tuple[dict, int]:
    from mexc.backends.llvm.products import host_cpu
    from mexc.backends.llvm.step import distinct_kernels
    from mexc.backends.llvm.workspace import kernel_workspace_bytes
    from mexc.lowering import step_plan
    from mexc.lowering.cpu_gemm import schedule_parallel

    torch.manual_seed(0)
    prog = mexc.compile(make(), (torch.zeros(batch, *shape),))
    cpu = host_cpu()
    plan = step_plan.build_plan(prog, cpu.gemm_lanes, "cpu", cpu.gemm_kernel)
    funcs, _ = distinct_kernels(plan, schedule_parallel)
    return kernel_workspace_bytes(funcs, cpu.target()), step_plan.plan_peak(plan)[0]


@pytest.mark.parametrize("name", ["FashionCNN", "SmallResNet"])
def test_no_host_kernel_allocates_a_large_workspace(name: str) -> None:
    """What kernels allocate for themselves at run time (TVM's workspace, outside the arena)
    stays a small share of the arena: a max pool's int32 window maxima (FashionCNN) and a
    strided gradient merge's partial maxima (SmallResNet) were each 16-24 % of it."""
    from examples.models import EXAMPLES

    workspace, peak = _workspace_and_peak(*EXAMPLES[name], 32)
    largest = max(workspace, key=lambda k: workspace[k])
    assert 8 * workspace[largest] <= peak, (largest, workspace[largest], peak)
    pools = [k for k in workspace if "maxpool" in k and "grad" not in k]
    assert all(workspace[k] == 0 for k in pools)


def _segmenter() -> Any:
    from tests.compiler.test_position_labels import Segmenter

    return Segmenter()


@pytest.mark.parametrize("name", ["MobileNetV2Tiny", "Segmenter"])
def test_no_kernel_holds_workspace_that_grows_much_with_the_batch(name: str) -> None:
    """From batch 8 to 32, no kernel's own workspace grows by more than a sixth of what the
    plan's peak grows (a per-pixel loss's exponentials, int64 per class, grew by half of it),
    and the per-row loss's and the depthwise weight gradients' do not grow at all (they held
    every row's, and every sample's plane per channel)."""
    from examples.models import EXAMPLES

    make, shape = (_segmenter, (1, 32, 32)) if name == "Segmenter" else EXAMPLES[name]
    (small, p_small), (large, p_large) = (_workspace_and_peak(make, shape, b) for b in (8, 32))
    grown = {k: large[k] - small.get(k, 0) for k in large}  # (a kernel of one plan only: all)
    worst = max(grown, key=lambda k: grown[k])
    assert 6 * grown[worst] <= p_large - p_small, (worst, grown[worst], p_large - p_small)
    flat = [k for k in grown if k.endswith(("_depthwise", "_softmax_ce", "_softmax_ce_grad"))]
    assert flat and all(grown[k] == 0 for k in flat), {k: grown[k] for k in flat}


def test_a_launch_whose_buffers_do_not_fit_its_kernel_is_refused() -> None:
    """The host kernels do not check their arguments (kernel_store.COMPILE_CONFIG): the plan's
    launches are checked against the kernels' parameters when it is built, symbolic extents
    (the per-shape update kernels of the host plan) bound once per launch."""
    from mexc.lowering.plan_core import Launch
    from mexc.lowering.step_plan import build_plan, check_launch_args

    torch.manual_seed(0)
    prog = mexc.compile(DigitsCNN(), (torch.zeros(4, 1, 8, 8),))
    plan = build_plan(prog, 8, "cpu")
    check_launch_args(plan)
    launches = [x for x in plan.launches if isinstance(x, Launch)]
    symbolic = [
        x for x in launches if any(not str(d).isdigit() for p in x.func.params for d in p.shape)
    ]
    assert symbolic  # the update kernels take (G, R)
    for bad in (launches[0], symbolic[0]):
        wrong = plan.launches.index(bad)
        for args in (bad.args[:-1], (*bad.args[:-1], plan.input[0])):
            plan.launches[wrong] = Launch(bad.func, args)
            with pytest.raises(ValueError, match=f"launch {bad.symbol}: "):
                check_launch_args(plan)
        plan.launches[wrong] = bad
    check_launch_args(plan)
