"""Channel exponents (docs/numerics.md §5) in a training program: below 8 bits every activation,
gradient and weight row keeps B bits at its own exponent in the tensor's int8 frame; at 8 bits
the option changes nothing; the TIR backends (llvm, the CUDA plan's host twin and the emulated
CUDA artifact) and the C target train and infer bit-exact with the reference."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mexc
from examples.models import EXAMPLES
from examples.vit import Block
from mexc.backends.c.emit import emit_model
from mexc.backends.c.host import CProgram
from mexc.backends.llvm import float_check as fc
from mexc.backends.llvm.step import LlvmProgram
from mexc.lowering.step_plan import leanest
from mexc.numerics import overflow_debug, qmax
from tests.compiler.test_fuzz import models as random_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


def _data(name: str, batch: int = 8, steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, shape = EXAMPLES[name]
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(steps)
    ]


def _program(
    name: str, bits: int, channels: bool, target: str = "reference", optimizer: str = "sgd"
) -> mexc.Program:
    cls, _ = EXAMPLES[name]
    torch.manual_seed(0)
    x0 = _data(name)[0][0]
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4) if optimizer == "sgd" else optimizer
    return mexc.compile(cls(), (x0,), opt, bits=bits, target=target, channel_exponents=channels)


@pytest.mark.parametrize(
    ("name", "optimizer"), [("FashionCNN", "sgd"), ("SmallResNet", "sgd"), ("FashionCNN", "adamw")]
)
def test_low_bit_training_keeps_each_weight_row_at_b_bits_in_the_frame(
    name: str, optimizer: str
) -> None:
    prog = _program(name, 4, True, optimizer=optimizer)
    plain = _program(name, 4, False, optimizer=optimizer)
    losses = [prog.step(x, y) for x, y in _data(name)]
    plain_losses = [plain.step(x, y) for x, y in _data(name)]
    assert all(np.isfinite(losses)) and losses != plain_losses
    wider = 0
    for pname, p in prog.state.items():
        if pname.endswith(("velocity", ".m", ".r", "running_mean", "running_var")) or p.e.ndim:
            continue
        m = p.m.astype(np.int64).reshape(p.m.shape[0], -1) if p.m.ndim else p.m.reshape(1, 1)
        assert np.abs(m).max() <= qmax(4) << 4, pname
        for row in m:  # a B-bit mantissa at the row's own exponent
            nz = row[row != 0]
            if nz.size:
                unit = 1 << int(np.min([(int(v) & -int(v)).bit_length() - 1 for v in nz]))
                assert np.abs(row // unit).max() <= qmax(4), pname
        wider += int(np.abs(m).max() > qmax(4))
    assert wider > 0  # the frame is used: some weights lie above qmax(4)


@pytest.mark.parametrize("name", ["FashionCNN", "SmallResNet", "MobileNetV2Tiny", "MLP"])
def test_the_fast_kernels_round_as_the_checked_numerics(name: str) -> None:
    """Overflow debugging runs numerics.channel_compact itself and the general batch-norm
    kernels; without it the fast kernels run: the same bits."""
    fast, checked = _program(name, 4, True), _program(name, 4, True)
    data = _data(name, steps=3)
    want = [fast.step(x, y) for x, y in data]
    with overflow_debug():
        got = [checked.step(x, y) for x, y in data]
    assert got == want and checked.state_checksum() == fast.state_checksum()


def test_at_8_bits_the_option_changes_nothing() -> None:
    a, b = _program("FashionCNN", 8, True), _program("FashionCNN", 8, False)
    for x, y in _data("FashionCNN", steps=2):
        assert a.step(x, y) == b.step(x, y)
    assert a.state_checksum() == b.state_checksum()
    assert "channel_exponents" not in a.ir.splitlines()[0]


def test_a_checkpoint_keeps_the_option_and_resumes_bit_exact(tmp_path: Path) -> None:
    data = _data("FashionCNN")
    whole = _program("FashionCNN", 4, True)
    for x, y in data:
        whole.step(x, y)
    first = _program("FashionCNN", 4, True)
    for x, y in data[:2]:
        first.step(x, y)
    first.save(tmp_path / "ck")
    resumed = mexc.load(tmp_path / "ck")
    assert resumed.options.channel_exponents
    assert "channel_exponents=true" in resumed.ir.splitlines()[0]  # insert-mx-types' mark
    for x, y in data[2:]:
        resumed.step(x, y)
    assert resumed.state_checksum() == whole.state_checksum()


@pytest.mark.parametrize(
    ("name", "optimizer", "bits"),
    [("FashionCNN", "sgd", 4), ("SmallResNet", "sgd", 6), ("MLP", "adamw", 4)],
)
def test_the_c_target_trains_bit_exact(name: str, optimizer: str, bits: int) -> None:
    """The runtime's sinks round per channel where the reference's batch-major compactions do,
    the generated products scan channel maxima and round with each channel's shifts, and the
    updates rescale each weight row: the reference's bits."""
    ref = _program(name, bits, True, optimizer=optimizer)
    _same_training(ref, _program(name, bits, True, "c", optimizer=optimizer), _data(name, steps=3))


def test_the_c_step_rounds_products_activations_and_weight_rows_per_channel() -> None:
    src = emit_model(_program("FashionCNN", 4, True), 4).source
    assert "_cscan(" in src and "_cround(" in src and "_scan(" not in src
    assert "ctx.chan = mexc_chan0;" in src and "cfg.rows = &mexc_chan" in src
    assert "mexc_chan" not in emit_model(_program("FashionCNN", 4, False), 4).source


def test_auto_compiles_it_for_the_host() -> None:
    prog = _program("FashionCNN", 4, True, "auto")
    assert isinstance(prog, LlvmProgram) and prog.options.channel_exponents


def _same_training(ref: mexc.Program, other: mexc.Program, data: list) -> None:
    """The same loss at every step, the same state after each, then the same logits."""
    for step, (x, y) in enumerate(data):
        loss, want = other.step(x, y), ref.step(x, y)
        # the C step reports its loss in thousandths (for printing); its state is exact
        close = abs(loss - want) <= 1e-3 if isinstance(other, CProgram) else loss == want
        assert close, f"loss differs at step {step}: {loss} against {want}"
        assert other.state_checksum() == ref.state_checksum(), f"state differs at step {step}"
    xe = np.random.default_rng(5).standard_normal((7, *ref.input_shape)).astype(np.float32)
    assert np.array_equal(other.logits(xe), ref.logits(xe))


@pytest.mark.parametrize(
    ("name", "optimizer", "bits"),
    [
        ("FashionCNN", "sgd", 4),
        ("SmallResNet", "sgd", 6),
        ("MLP", "adamw", 4),
    ],
)
def test_llvm_trains_bit_exact(name: str, optimizer: str, bits: int) -> None:
    """Every batch-major compaction as channel maxima, shifts and rounding kernels (the
    products' accumulators stored first), batch norm's xhat lifted into its frame, the weight
    rows rescaled per row: the reference's bits."""
    ref = _program(name, bits, True, optimizer=optimizer)
    llvm = _program(name, bits, True, "llvm", optimizer=optimizer)
    assert isinstance(llvm, LlvmProgram)
    _same_training(ref, llvm, _data(name, steps=3))
    fc.check_integer_only(llvm)  # raises, naming each float instruction, if any


# SmallResNet's GPU plan: at its leanest below, and its CUDA build on the H200 (docs/cuda.md)
@pytest.mark.parametrize("name", ["FashionCNN"])
def test_the_gpu_plan_trains_bit_exact_on_the_host(name: str) -> None:
    ref = _program(name, 4, True)
    _same_training(ref, LlvmProgram(_program(name, 4, True), plan_device="gpu"), _data(name))


@pytest.mark.parametrize(
    ("name", "device", "lean", "pack_budget"),
    [
        ("FashionCNN", "cpu", True, None),
        ("SmallResNet", "gpu", True, None),
        ("SmallResNet", "cpu", False, 2048),
    ],
)
def test_lean_and_chunked_plans_are_bit_exact(
    name: str, device: str, lean: bool, pack_budget: int | None
) -> None:
    """Channel maxima scanned chunk by chunk from each GEMM's C, then rounded from C again
    (every product and batch-norm gradient at its leanest); products over batch chunks whose Cs
    lie side by side (a small pack budget)."""
    prog = _program(name, 4, True)
    levels = leanest(prog, device) if lean else {}
    assert not lean or levels
    other = LlvmProgram(prog, plan_device=device, lean=levels, pack_budget=pack_budget)
    _same_training(_program(name, 4, True), other, _data(name, steps=3))


class _ManyOps(nn.Module):
    """Batch norm, hardswish, sigmoid times SiLU, a grouped and a strided convolution, average
    and overlapping max pooling, ReLU6 and a concatenation: each op's compaction forms."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = nn.functional
        a = f.hardswish(self.bn(self.c1(x)))
        b = torch.sigmoid(self.c2(a)) * f.silu(self.c3(f.avg_pool2d(a, 2)))
        c = torch.cat([b, f.max_pool2d(f.relu6(b), 3, 1, 1)], 1)
        return self.fc(f.avg_pool2d(c, 2).flatten(1))


@pytest.mark.parametrize("device", ["cpu", "gpu", "c"])
def test_many_ops_train_bit_exact(device: str) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 1, 8, 8, generator=g) * 3, torch.randint(0, 10, (4,), generator=g))]
    data *= 3

    def program(target: str = "reference") -> mexc.Program:
        torch.manual_seed(0)
        opt = mexc.SGD(0.05, 0.9, weight_decay=1e-3)
        return mexc.compile(_ManyOps(), (data[0][0],), opt, bits=4, target=target)  # on below 8

    ref = program()
    assert ref.options.channel_exponents
    other = program("c") if device == "c" else LlvmProgram(program(), device)
    _same_training(ref, other, data)


class _Tokens(nn.Module):
    """Patches as tokens through a transformer block (layer norm, attention, GELU MLP, the
    positional sum) and a token mean: a linear layer's result rounds per feature (its rows
    view), the other token tensors per token (axis 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 16, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 4, 16) * 0.5)
        self.block = Block(16, 2, 2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.block(x + self.pos).mean(dim=1))


def _tokens(target: str) -> tuple[mexc.Program, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))]
    torch.manual_seed(0)
    opt = mexc.SGD(0.05, 0.9)
    prog = mexc.compile(
        _Tokens(), (data[0][0],), opt, bits=4, target=target, channel_exponents=True
    )
    return prog, data * 3


def test_a_transformer_block_trains_bit_exact_on_the_gpu_plan() -> None:
    """(The llvm plan of the ViT: the data-parallel test, tests/distributed.)"""
    ref, data = _tokens("reference")
    _same_training(ref, LlvmProgram(_tokens("reference")[0], "gpu"), data)


def test_a_transformer_block_trains_bit_exact_in_c() -> None:
    """Layer norm's rows keep their plain rule, its output and the attention's products round
    per token, a linear layer's per feature, matmul_grad's two results each by its own."""
    ref, data = _tokens("reference")
    _same_training(ref, _tokens("c")[0], data)


@settings(max_examples=2, deadline=None)
@given(model=random_models(), bits=st.sampled_from([4, 6]), seed=st.integers(0, 2**16))
def test_random_models_train_bit_exact_on_llvm(model: nn.Module, bits: int, seed: int) -> None:
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(seed))

    def program(target: str) -> mexc.Program:
        torch.manual_seed(seed)
        return mexc.compile(
            copy.deepcopy(model),
            (x,),
            mexc.SGD(0.05, 0.9),
            bits=bits,
            target=target,
            channel_exponents=True,
            seed=seed,
        )

    _same_training(program("reference"), program("llvm"), [(x, y)] * 3)


@needs_cuda_tools
def test_the_emulated_cuda_artifact_trains_bit_exact() -> None:
    """The artifact nvcc builds for sm_80 and sm_90, its kernels run on the CPU emulator."""
    from mexc.backends.cuda.build import cached_artifact
    from mexc.backends.cuda.emulator import emulate
    from mexc.backends.cuda.sass_check import verify_artifact

    ref = _program("FashionCNN", 4, True)
    archs = ("sm_80", "sm_90")
    emu = emulate(_program("FashionCNN", 4, True), archs)
    folder = cached_artifact(_program("FashionCNN", 4, True), archs, eval_plan=False)
    assert verify_artifact(folder, json.loads((folder / "plan.json").read_text())) == []
    for x, y in _data("FashionCNN", steps=2):
        assert emu.step(x, y) == ref.step(x, y)
    assert emu.state_checksum() == ref.state_checksum()
