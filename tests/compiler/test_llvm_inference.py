"""Compiled inference on target="llvm" (and the CUDA artifact of the same plan on the emulator,
and the GPU plan's llvm twin): predict / evaluate / logits run the inference launch plan
(step_plan.build_inference_plan: eval-mode batch norm on the running statistics, dropout off,
the logits as the classifier's int32 accumulator) over the training step's state buffers, and
equal the reference bit for bit: the logits' accumulators and exponents batch by batch, the
predictions and the accuracy, after a few training steps, for a row count that is not a
multiple of the batch (the last batch padded with zero rows, as the reference does)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.backends.llvm.step import LlvmProgram
from mexc.lowering.step_plan import build_inference_plan
from mexc.mx import Acc
from tests.compiler.helpers import EXAMPLES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


def _optimizer() -> mexc.SGD:
    # tests/codegen/test_llvm_step.py's: the same models at the same batch are then the same
    # programs, and their compiled steps come from the kernel cache
    return mexc.SGD(
        lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, warmup_steps=2)
    )


def _pair(factory, batch: int, shape: tuple[int, ...]) -> tuple[mexc.Program, LlvmProgram]:
    progs = []
    for target in ("reference", "llvm"):
        torch.manual_seed(0)
        progs.append(
            mexc.compile(
                factory(), (torch.zeros(batch, *shape),), optimizer=_optimizer(), target=target
            )
        )
    ref, llvm = progs
    assert isinstance(llvm, LlvmProgram)
    return ref, llvm


def _assert_same_inference(ref: mexc.Program, llvm: mexc.Program, x: np.ndarray) -> None:
    want, got = ref.logit_batches(x), llvm.logit_batches(x)
    assert [n for _, n in got] == [n for _, n in want]
    for (a, _), (b, _) in zip(want, got):
        assert type(a) is type(b)
        av, bv = (a.a, b.a) if isinstance(a, Acc) else (a.m, b.m)
        assert np.array_equal(np.asarray(av, np.int64), np.asarray(bv, np.int64))
        assert int(a.e) == int(b.e)
    assert np.array_equal(llvm.logits(x), ref.logits(x))


@pytest.mark.parametrize(
    "name,batch", [("MLP", 8), ("FashionCNN", 4), ("SmallResNet", 2), ("MobileNetV2Tiny", 2)]
)
def test_compiled_inference_is_the_reference(name: str, batch: int) -> None:
    cls, shape = EXAMPLES[name]
    ref, llvm = _pair(cls, batch, shape)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    rows = 3 * batch + batch // 2 + 1  # not a multiple of the batch
    xe = rng.standard_normal((rows, *shape)).astype(np.float32)
    ye = rng.integers(0, 10, rows)
    _assert_same_inference(ref, llvm, xe)  # before training: the initial state
    for _ in range(3):
        assert llvm.step(x, y) == ref.step(x, y)
    assert llvm.state_checksum() == ref.state_checksum()
    # after k steps the inference plan sees the live state (shared buffers, no copy)
    _assert_same_inference(ref, llvm, xe)
    assert llvm._inference_plan() is not None
    assert np.array_equal(llvm.predict(xe), ref.predict(xe))
    assert llvm.evaluate(xe, ye) == ref.evaluate(xe, ye)
    assert llvm.step(x, y) == ref.step(x, y)
    _assert_same_inference(ref, llvm, xe[:1])  # one row: a single padded batch


class _DropoutHead(nn.Module):
    """Dropout before the classifier and batch norm on (N, C): eval mode turns the first off
    and normalizes the second with the running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x.flatten(1))))))


def test_dropout_and_batchnorm1d_eval() -> None:
    ref, llvm = _pair(_DropoutHead, 6, (12,))
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((6, 12)), rng.integers(0, 10, 6)
    for _ in range(2):
        assert llvm.step(x, y) == ref.step(x, y)
    _assert_same_inference(ref, llvm, rng.standard_normal((13, 12)))


def test_inference_follows_a_loaded_state_and_the_separate_layout() -> None:
    """load_state_dict writes the shared buffers: predict sees it. layout="separate" (no arena
    to share) gives the same bits."""
    ref, llvm = _pair(_DropoutHead, 6, (12,))
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((6, 12)), rng.integers(0, 10, 6)
    xe = rng.standard_normal((7, 12))
    _assert_same_inference(ref, llvm, xe)  # compiles the inference plan on the initial state
    for _ in range(3):
        ref.step(x, y)
    llvm.load_state_dict(ref.state_dict())
    _assert_same_inference(ref, llvm, xe)
    separate = LlvmProgram(ref.retargeted("llvm"), layout="separate")
    _assert_same_inference(ref, separate, xe)


def test_the_inference_plan_shares_the_state_and_leaves_it_alone() -> None:
    cls, shape = EXAMPLES["SmallResNet"]
    _, llvm = _pair(cls, 2, shape)
    plan = build_inference_plan(llvm)
    state = {name for pair in plan.state.values() for name in pair}
    assert state and state <= set(llvm.plan["buffers"])  # the training plan's buffers, by name
    m, _ = plan.logits
    root = plan.views[m].base if m in plan.views else m
    assert plan.buffers[root][1] == "int32"  # the logits are the accumulator
    before = llvm.buffer_digests()
    llvm.predict(np.random.default_rng(0).standard_normal((5, *shape)))
    inf_manifest = llvm._inference_plan()
    assert inf_manifest is not None
    bufs = llvm._inf[1] if llvm._inf is not None else None
    assert bufs is not None
    for name in state:  # the same memory, not a copy
        assert np.shares_memory(bufs.np[name], llvm._bufs.np[name])
    assert llvm.buffer_digests() == before


def _trained_reference(name: str, batch: int, steps: int = 2) -> tuple[mexc.Program, tuple]:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    ref = mexc.compile(cls(), (torch.zeros(batch, *shape),), optimizer=_optimizer())
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((batch, *shape)), rng.integers(0, 10, batch)
    for _ in range(steps):
        ref.step(x, y)
    return ref, shape


def test_gpu_variant_of_the_inference_plan_on_the_host() -> None:
    """The GPU plan's inference (padded GEMM forms, the GPU's rules, batch norm on the
    running statistics) run by the llvm twin."""
    ref, shape = _trained_reference("DigitsCNN", 2)
    twin = LlvmProgram(ref.retargeted("llvm"), plan_device="gpu")
    x = np.random.default_rng(8).standard_normal((5, *shape))
    _assert_same_inference(ref, twin, x)


@needs_cuda_tools
@pytest.mark.parametrize("name", ["SmallResNet", "MLP"])
def test_cuda_inference_artifact_on_the_emulator(name: str, tmp_path: Path) -> None:
    """The CUDA artifact of the inference plan (build_step(..., inference=True)), its own
    kernel source emulated on the CPU in both launch orders, equals the reference."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import ORDER_LAYOUT, EmulatedCudaProgram
    from mexc.backends.cuda.program import StepArtifact

    ref, shape = _trained_reference(name, 2)
    man = build_step(ref, ("sm_80",), tmp_path, inference=True, cubins=False)
    assert "logits" in man and set(man["state"]) < set(ref.state)  # no velocities
    x = np.random.default_rng(9).standard_normal((5, *shape))
    for order, layout in ORDER_LAYOUT.items():
        emu = EmulatedCudaProgram(
            StepArtifact.load(tmp_path, sources=True),
            ref,
            reverse=order == "reverse",
            layout=layout,
        )
        _assert_same_inference(ref, emu, x)
