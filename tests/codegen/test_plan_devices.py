"""The devices a launch plan targets (mexc.lowering.devices): build_plan's device names, and
each capability of a Device as a switch of its own (flipping one changes its kernels and none
of the others'). The plans are only built here; test_llvm_step, test_plan_layout and
test_cuda_step train with them."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from tvm import tirx

import mexc
from mexc.ir import Op
from mexc.lowering import devices
from mexc.lowering.devices import GPU, HOST, Device, TileGemm, device_of
from mexc.lowering.plan_core import StepPlan, is_gemm
from mexc.lowering.step_plan import _host_gemm, build_plan


class Tiny(nn.Module):
    """Every device-dependent rule once: a batch norm (its backward bracket), a depthwise
    stride-1 convolution (direct kernels), a strided convolution (sub-pixel input gradient),
    weight gradients and updates of several shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.down(self.dw(x)))
        return self.fc(torch.flatten(x, 1))


@pytest.fixture(scope="module")
def prog() -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Tiny(), (torch.zeros(4, 1, 8, 8),))


def fingerprint(plan: StepPlan) -> tuple:
    """Everything of a plan a backend reads, in order, the kernels by their TVMScript."""
    return (
        list(plan.buffers.items()),
        list(plan.views.items()),
        [(k, v.dtype.str, v.tobytes()) for k, v in plan.constants.items()],
        plan.key_ids,
        list(plan.state.items()),
        (plan.input, plan.labels, plan.valid, plan.lr, plan.loss_rows),
        [(x.symbol, x.args, x.func.script()) for x in plan.launches],
    )


def _symbolic(func: tirx.PrimFunc) -> bool:
    """Whether a buffer of `func` has a shape bound at call time."""
    shapes = [getattr(p, "shape", ()) for p in func.params]
    return any(not isinstance(d, tirx.IntImm) for shape in shapes for d in shape)


def _swapped(prog: mexc.Program) -> Callable[[StepPlan], bool]:
    """Whether the pack A of every dense conv weight gradient reads the convolution's input x
    (A = im2col), not dy (chunks read views of it). Dense ones only: the tiny model's x of
    those are buffers of their own, where a depthwise one's x is a ReLU's in-place result."""
    grads = {
        f"n{n.id}_dw_pack_a": f"v{n.inputs[1].node}_{n.inputs[1].index}"
        for n in prog.graph.nodes_of(Op.CONV2D_GRAD_WEIGHT)
        if int(n.attrs.groups) == 1
    }

    def check(plan: StepPlan) -> bool:
        packs = [(x.symbol.split("_k")[0], x.args[0].split("@")[0]) for x in plan.launches]
        reads = [grads[s] == src for s, src in packs if s in grads]
        assert reads
        return all(reads)

    return check


def markers(prog: mexc.Program) -> dict[str, Callable[[StepPlan], bool]]:
    """Per Device field, what the plan shows of it."""
    return {
        "gemm": lambda p: any(is_gemm(x.func) for x in p.launches),
        "pack_budget": lambda p: any(x.symbol.endswith("_k1") for x in p.launches),
        "direct_depthwise": lambda p: any("_depthwise" in x.symbol for x in p.launches),
        "subpixel_input_grad": lambda p: any(
            x.symbol.endswith("_dx_merge_shift") for x in p.launches
        ),
        "symbolic_update": lambda p: any(
            "_sgd" in x.symbol and _symbolic(x.func) for x in p.launches
        ),
        "swapped_weight_grad": _swapped(prog),
        "row_max_bracket": lambda p: any(k.endswith(".t_amax") for k in p.buffers),
        # the loss head's probabilities divide by the row sum: by the target's division
        # (TIR's Div) or by te_divide's long division (shifts and selects in a loop)
        "native_division": lambda p: any(
            x.symbol.endswith("_softmax_ce") and "T.Div(" in x.func.script() for x in p.launches
        ),
        # the update's whole-tensor maxima reduce each row first (a block of its own)
        "rows_first_update": lambda p: any(
            x.symbol.endswith("_sgd_w_target") and "w_nonzero_rows" in x.func.script()
            for x in p.launches
        ),
    }


def test_device_names_stand_for_the_devices(prog: mexc.Program) -> None:
    assert device_of("cpu") is HOST and device_of("gpu") is GPU and device_of(GPU) is GPU
    assert devices.DEVICES == {"cpu": HOST, "gpu": GPU}
    with pytest.raises(ValueError, match="not one of"):
        device_of("tpu")
    for name, device in (("cpu", HOST), ("gpu", GPU)):
        by_name = build_plan(prog, device=name, lean={})
        assert fingerprint(by_name) == fingerprint(build_plan(prog, device=device, lean={}))
    budget = dataclasses.replace(HOST, pack_budget=2048)
    assert fingerprint(build_plan(prog, device=budget, lean={})) == fingerprint(
        build_plan(prog, device="cpu", pack_budget=2048, lean={})
    )


def test_a_gpu_plan_does_not_depend_on_the_host_gemm(prog: mexc.Program) -> None:
    """The host twin (LlvmProgram(plan_device="gpu")) passes its own GEMM lanes and kernel: the
    GPU plan must still be the one the CUDA build makes with the defaults (the kernel's cost
    per MAC steers the lean search)."""
    assert _host_gemm(GPU, 16, "vnni_i8") == (8, GPU, "int32")
    assert _host_gemm(HOST, 16, "vnni_i8") == (16, HOST, "vnni_i8")
    twin = build_plan(prog, 16, GPU, "vnni_i8")
    assert fingerprint(twin) == fingerprint(build_plan(prog, 8, GPU))


# what a Device field changes in a plan, where the tiny model shows it; packs_within_peak
# changes a plan only where the budget chunks it: test_plan_layout's packs test
SHOWN = [f.name for f in dataclasses.fields(Device) if f.name not in ("name", "packs_within_peak")]


def test_the_devices_differ_in_every_capability(prog: mexc.Program) -> None:
    assert set(markers(prog)) == set(SHOWN)
    host, gpu = build_plan(prog, device=HOST, lean={}), build_plan(prog, device=GPU, lean={})
    for field, shows in markers(prog).items():
        if field == "pack_budget":  # the tiny model fits both budgets
            continue
        assert shows(host) != shows(gpu), field


@pytest.mark.parametrize("field", SHOWN)
def test_each_capability_switches_its_own_kernels_only(prog: mexc.Program, field: str) -> None:
    flipped: Any = {"pack_budget": 2048, "gemm": TileGemm()}.get(field, not getattr(HOST, field))
    device = dataclasses.replace(HOST, **{field: flipped})
    base, plan = build_plan(prog, device=HOST, lean={}), build_plan(prog, device=device, lean={})
    for name, shows in markers(prog).items():
        changed = shows(base) != shows(plan)
        assert changed == (name == field), (field, name)


def test_no_plan_rule_tests_a_device_name() -> None:
    lowering = Path(devices.__file__).parent
    for path in sorted(lowering.glob("plan_*.py")):
        text = path.read_text()
        assert not re.search(r"device\s*[!=]=|device\.name", text), path.name
