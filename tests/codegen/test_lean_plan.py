"""Lean nodes (docs/memory.md): products that run over more chunks or scan, then round, and
batch-norm backward passes that never store their bracket, bit-exact with the reference; and
the search that picks them where they lower the step's peak."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import mexc
from examples.models import EXAMPLES
from mexc.lowering.devices import device_of
from mexc.lowering.step_plan import (
    LEAN_WORK_SHARE,
    lean_nodes,
    leanest,
    plan_builder,
    plan_peak,
)


@pytest.mark.parametrize(
    "name,batch,device",
    [
        ("FashionCNN", 8, "cpu"),
        ("SmallResNet", 4, "cpu"),
        ("MobileNetV2Tiny", 4, "cpu"),
        ("FashionCNN", 8, "gpu"),
        ("MobileNetV2Tiny", 4, "gpu"),
    ],
)
def test_every_node_at_its_leanest_trains_bit_exact(name: str, batch: int, device: str) -> None:
    """Every lean form at once (8-chunk scans of the convolutions and of the strided input
    gradients' phases, weight gradients in chunks, batch norms without a stored bracket)
    trains as the reference does; on the host plan and on the GPU plan (run on the host)."""
    from mexc.backends.llvm.step import LlvmProgram

    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    model = cls()
    x = np.random.default_rng(3).standard_normal((batch, *shape)).astype(np.float32)
    y = np.arange(batch) % 10
    ref = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),))
    lean = leanest(ref, device)
    assert len(lean) >= 4
    llvm = mexc.compile(model, (torch.from_numpy(x),)).retargeted("llvm")
    prog = LlvmProgram(llvm, plan_device=device, lean=lean)
    symbols = [s for s, _ in prog.plan["launches"]]
    assert any(s.endswith("_bn_bracket_max") for s in symbols)
    assert any("_amax_k" in s for s in symbols)  # a product's scan
    for step in range(3):
        assert prog.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert prog.state_checksum() == ref.state_checksum(), f"state differs after step {step}"


def test_the_search_lowers_the_peak_within_its_work_budget() -> None:
    """FashionCNN at batch 128: the first batch norm's bracket and the first convolution's C
    (6.4 MB each, int32) set the peak of the plain plan; the lean plan holds at most 3/4 of
    it, for at most LEAN_WORK_SHARE more work."""
    cls, shape = EXAMPLES["FashionCNN"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(128, *shape),))

    def build(lean):
        return plan_builder(prog, 8, device_of("cpu"), "int32", None, lean)

    plain = build({})
    chosen = lean_nodes(build)
    lean = build(chosen)
    assert chosen and set(chosen) <= set(plain.leanable)
    assert plan_peak(lean.plan)[0] * 4 <= plan_peak(plain.plan)[0] * 3
    assert lean.work <= plain.work * (1 + LEAN_WORK_SHARE)
