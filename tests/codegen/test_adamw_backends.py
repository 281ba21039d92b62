"""Integer AdamW on every backend: the same losses and state checksums as the reference, step by
step (docs/numerics.md section 12b), on the llvm step, its GPU plan run on the host, the CUDA
artifact's own source emulated on the CPU, and the C target; the exported MCU project is
checked in tests/mcu/test_c_backend.py."""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cuda_products import needs_cuda_tools

import mexc
from examples.models import EXAMPLES
from mexc.backends.llvm.step import LlvmProgram


def _optimizer() -> mexc.AdamW:
    return mexc.AdamW(lr=3e-3, weight_decay=0.05, schedule=mexc.Cosine(20, warmup_steps=2))


def _program(
    name: str,
    batch: int,
    target: str = "reference",
    bits: int = 8,
    optimizer: mexc.AdamW | None = None,
) -> mexc.Program:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    x = torch.zeros(batch, *shape)
    opt = optimizer or _optimizer()
    return mexc.compile(cls(), (x,), optimizer=opt, target=target, bits=bits)


def _trains_like(program: mexc.Program, ref: mexc.Program, steps: int, loss_abs: float = 0) -> None:
    """The same state after every step; the same loss (the C step reports it to 1e-3)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((ref.batch, *ref.input_shape)).astype(np.float32)
    y = rng.integers(0, ref.num_classes, ref.batch)
    for step in range(steps):
        loss, want = program.step(x, y), ref.step(x, y)
        assert loss == pytest.approx(want, rel=0, abs=loss_abs), f"loss differs at step {step}"
        assert program.state_checksum() == ref.state_checksum(), f"state differs after {step}"


def test_state_holds_the_moments_and_the_loss_falls() -> None:
    prog = _program("DigitsCNN", 8)
    names = set(prog.state)
    assert {"conv1.weight.m", "conv1.weight.r"} <= names and not any("velocity" in n for n in names)
    assert prog.state["conv1.weight.r"].e.shape == (prog.state["conv1.weight"].m.shape[0],)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, *prog.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    losses = [prog.step(x, y) for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name,bits", [("DigitsCNN", 8), ("MLP", 6)])
def test_llvm_is_bit_exact(name: str, bits: int) -> None:
    _trains_like(_program(name, 4, "llvm", bits), _program(name, 4, bits=bits), steps=3)


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("objdump") is None,
    reason="the float scan reads x86-64 objdump output",
)
def test_llvm_update_kernels_are_integer_only() -> None:
    from mexc.backends.llvm import float_check as fc

    prog = _program("DigitsCNN", 4, "llvm")
    report = fc.check_integer_only(prog)  # raises, naming each float instruction, if any
    assert report.floats == [] and report.missing == []
    assert set(report.kernels) == set(fc.launch_symbols(prog._plan_json))  # the update's too
    assert all(n > 0 for n in report.kernels.values())


def test_gpu_plan_on_the_host_is_bit_exact() -> None:
    gpu = LlvmProgram(_program("DigitsCNN", 4), plan_device="gpu")
    _trains_like(gpu, _program("DigitsCNN", 4), steps=3)


def test_c_target_is_bit_exact() -> None:
    _trains_like(_program("DigitsCNN", 4, "c"), _program("DigitsCNN", 4), steps=3, loss_abs=5e-4)


@pytest.mark.parametrize("target", ["llvm", "c"])
def test_adam_with_coupled_decay_is_bit_exact(target: str) -> None:
    """mexc.Adam(weight_decay=...): the L2 term of numerics 12b step 1b (three more kernels on
    llvm, a branch of the C runtime's update)."""
    opt = mexc.Adam(lr=3e-3, weight_decay=0.05)
    fast = _program("MLP", 4, target, optimizer=opt)
    _trains_like(fast, _program("MLP", 4, optimizer=opt), steps=3, loss_abs=5e-4)


@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_emulated_cuda_is_bit_exact() -> None:
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import EmulatedCudaProgram
    from mexc.backends.cuda.program import StepArtifact
    from mexc.backends.cuda.sass_check import verify_artifact

    with tempfile.TemporaryDirectory() as out:
        build_step(_program("MLP", 2), ("sm_80",), out)
        manifest = json.loads((Path(out) / "plan.json").read_text())
        assert verify_artifact(Path(out), manifest) == []  # no float in the source or the SASS
        artifact = StepArtifact.load(out)
        assert isinstance(artifact.program.optimizer, mexc.AdamW)
        _trains_like(EmulatedCudaProgram(artifact, reverse=True), artifact.program, steps=3)


def test_checkpoint_round_trip_keeps_the_optimizer(tmp_path) -> None:
    prog = _program("MLP", 4)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, *prog.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    prog.step(x, y)
    prog.save(tmp_path / "ckpt")
    back = mexc.load(tmp_path / "ckpt")
    assert back.optimizer == prog.optimizer and back.state_checksum() == prog.state_checksum()
    assert back.step(x, y) == prog.step(x, y) and back.state_checksum() == prog.state_checksum()
