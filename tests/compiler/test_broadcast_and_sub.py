"""Broadcasting an activation's axes of size 1 (a spatial gate [N, 1, H, W] times [N, C, H, W],
a global context [N, C, 1, 1] added, expand_as), subtraction and negation (a scale by -1), and
an accumulator started at 0: torch's values and gradients, and a model of all of them trained
bit-exact on reference, llvm, C and the emulated CUDA source."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    step_values,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


def _trained_on_every_target(make: type[nn.Module], x: np.ndarray, y: np.ndarray) -> mexc.Program:
    """make() on x's shape trains bit-exact on reference, llvm and C (3 steps on (x, y));
    the reference program."""

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(make(), (torch.zeros(*x.shape),), target=target)

    ref = program("reference")
    assert_trains_bit_exact_on_llvm_and_c(ref, program, (x, y))
    return ref


class GatesAndDifferences(nn.Module):
    """CBAM's spatial attention (channel mean and max, a convolution, a sigmoid gate over the
    channels), a global-context sum (GCNet), PoolFormer's x - pool(x), expand_as, negation and
    an accumulator started at 0 (FocalNet, MobileOne)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.spatial = nn.Conv2d(2, 1, 3, padding=1)
        self.context = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        stats = torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)
        y = x * torch.sigmoid(self.spatial(stats))
        g = self.context(y.mean((2, 3), keepdim=True))
        y = y + g - F.avg_pool2d(y, 3, 1, 1)
        total = 0
        for part in (y, -(g.expand_as(y) * 0.5)):
            total = total + part
        return self.fc(torch.flatten(total, 1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(GatesAndDifferences(), (torch.zeros(4, 1, 8, 8),), target=target, bits=bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    assert {float(n.attrs.value) for n in ref.graph.nodes_of(Op.SCALE)} == {-1.0, 0.5}
    scales = [tuple(n.attrs.scale) for n in ref.graph.nodes_of(Op.UPSAMPLE_NEAREST)]
    assert sorted(scales) == [(8, 1), (64, 1), (64, 1)]  # the gate over C, g twice over H W
    assert_trains_bit_exact_on_llvm_and_c(ref, lambda t: _program(t, bits))


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = GatesAndDifferences()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


class SpatialGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.gate = nn.Conv2d(8, 1, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.fc(torch.flatten(y * torch.sigmoid(self.gate(y)), 1))


def test_the_gate_learns_from_the_summed_copies() -> None:
    """The gate's gradient is dy * x summed over the channels it was copied to (the
    upsampling's backward): with the stochastic rounding training uses, both convolutions'
    gradients have cosine >= 0.99 with torch's (measured 0.997 for the gate at batch 32; with
    nearest rounding the two compactions of a sum with much cancellation give 0.94)."""
    torch.manual_seed(0)
    model = SpatialGate()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    assert_gradients_follow_autograd(
        model, prog, x, y, ("gate.weight", "gate.bias", "conv.weight", "fc.weight"), 0.99
    )


class Negate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(0 - x)


def test_negation_is_exact() -> None:
    """-x is a scale by -1: acc = -m 2^14 at e - 14, which the compaction shifts back exactly
    (a mantissa of -128 would round; the input quantizer gives at most |127|)."""
    prog = mexc.compile(Negate(), (torch.zeros(4, 16),))
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    values = step_values(prog, x, np.zeros(4, np.int64))
    (neg,) = prog.graph.nodes_of(Op.SCALE)
    np.testing.assert_array_equal(values[neg.out].dequantize(), -values[neg.inputs[0]].dequantize())


class Numbers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(((x - 1.5) + (1 - x) * 0.5 + 0.25) + torch.add(x, 3))


def test_numbers_added_and_subtracted_are_constants() -> None:
    """x - 1.5, 1 - x, + 0.25, torch.add(x, 3): add_param of a constant [1] (exact for these
    dyadic numbers), never trained; the forward equals torch's within the roundings."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8)
    torch.manual_seed(0)
    model = Numbers()
    prog = mexc.compile(model, (torch.zeros(8, 4),), rounding="nearest")
    constants = sorted(k for k in prog.state if k.endswith(".constant"))
    values = sorted(float(prog.state[k].dequantize()[0]) for k in constants)
    assert values == [-1.5, 0.25, 1.0, 3.0]
    before = {k: prog.state[k].dequantize().copy() for k in constants}
    assert_logits_match_torch(model, prog, x)
    prog.step(x, y)
    assert all(np.array_equal(prog.state[k].dequantize(), before[k]) for k in constants)


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)


class Powers(nn.Module):
    """x ** 2 (StarReLU's relu(x) ** 2), torch.square, Tensor.square and x.pow(3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h**2 + torch.square(h) + h.pow(3) + h.square())


def test_whole_powers_are_products() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 3, 16)
    ref = _trained_on_every_target(Powers, x, y)
    assert len(list(ref.graph.nodes_of(Op.MUL))) >= 5  # forward: 1 + 1 + 2 + 1
    torch.manual_seed(0)
    model = Powers()
    prog = mexc.compile(model, (torch.zeros(16, 8),))
    ints, floats = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert all(cosine(ints[k], floats[k]) >= 0.99 for k in ints), ints.keys()


class RootOf(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(x) ** self.k)


@pytest.mark.parametrize(
    ("k", "says"), [(0.5, "square root of an activation"), (0.3, "whole power 1..4")]
)
def test_a_fractional_power_is_refused(k: float, says: str) -> None:
    with pytest.raises(UnsupportedOpError, match=says):
        mexc.compile(RootOf(k), (torch.zeros(2, 4),))


class SplitAttention(nn.Module):
    """ResNeSt's split attention: the radix splits summed (x.sum(dim=1)), their gates a
    softmax over the radix axis (not the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = nn.Conv2d(4, 8, 1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))  # (B, 2 x 4, H, W)
        b = y.shape[0]
        splits = y.reshape(b, 2, 4, 8, 8)
        gap = splits.sum(dim=1).mean((2, 3), keepdim=True)  # (B, 4, 1, 1)
        attn = F.softmax(self.fc1(gap).reshape(b, 2, 4), dim=1)  # over the radix
        out = (splits * attn.reshape(b, 2, 4, 1, 1)).sum(1)
        return self.fc(torch.flatten(out, 1))


def test_sums_and_a_softmax_over_a_middle_axis() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)
    _trained_on_every_target(SplitAttention, x, y)
    torch.manual_seed(0)
    model = SplitAttention()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    (softmax,) = prog.graph.nodes_of(Op.SOFTMAX)
    assert tuple(softmax.type.shape) == (8, 4, 2)  # the radix axis moved last
    assert 2.0 in {float(n.attrs.value) for n in prog.graph.nodes_of(Op.SCALE)}  # sum = 2 mean
    assert_logits_match_torch(model, prog, x)


class BroadcastParameters(nn.Module):
    """Parameters added along one run of axes: a bias per channel [C, 1, 1] and [1, C, 1, 1],
    StarReLU's scale * relu(x) ** 2 + bias with [1] parameters, a bias [D] on features and a
    positional [1, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.b1 = nn.Parameter(torch.randn(8, 1, 1) * 0.1)
        self.b2 = nn.Parameter(torch.randn(1, 8, 1, 1) * 0.1)
        self.scale = nn.Parameter(torch.ones(1))
        self.shift = nn.Parameter(torch.full((1,), 0.1))
        self.fc = nn.Linear(8 * 8 * 8, 16, bias=False)
        self.b3 = nn.Parameter(torch.randn(16) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 16) * 0.1)
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x) + self.b1) + self.b2
        y = self.scale * F.relu(y) ** 2 + self.shift
        h = self.fc(torch.flatten(y, 1)) + self.b3 + self.pos
        return self.out(F.relu(h))


def test_broadcast_parameters_train_bit_exact() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 16)
    ref = _trained_on_every_target(BroadcastParameters, x, y)
    nodes = ref.graph.nodes_of(Op.ADD_PARAM)
    views = sorted(tuple(n.attrs.view) for n in nodes)
    assert views == [(), (1, 1, 1, 1), (1, 8, 1, 1), (1, 8, 1, 1), (1, 16)]


class ChannelBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bias = nn.Parameter(torch.randn(8, 1, 1) * 0.1)
        self.shift = nn.Parameter(torch.full((1,), 0.1))
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.relu(self.conv(x) + self.bias) + self.shift, 1))


def test_broadcast_parameters_learn_torchs_gradients() -> None:
    """A bias per channel and a shift for all: their gradients (dy summed over the axes they
    broadcast along, int32) have cosine >= 0.99 with torch's at batch 32 (the convolution's
    weight behind them 0.988). (Deeper, the model above measures 0.94 to 0.98 for b1 and
    b2 at batches 16 and 64, as a convolution's own bias does in its place.)"""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 32)
    torch.manual_seed(0)
    model = ChannelBias()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    ints, floats = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    for name in ("bias", "shift"):
        assert ints[name].shape == floats[name].shape
        assert cosine(ints[name], floats[name]) >= 0.99, name
    assert cosine(ints["conv.weight"], floats["conv.weight"]) >= 0.98


class AddsAGrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 1, 4))
        self.fc = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x + self.p, 1))


def test_a_parameter_along_two_runs_of_axes_is_gathered() -> None:
    """[4, 1, 4] over (4, 4, 4) is not one run of axes (add_param's view): a gather_param of
    the parameter broadcast to the activation, then an add."""
    torch.manual_seed(0)
    model = AddsAGrid()
    prog = mexc.compile(model, (torch.zeros(8, 4, 4, 4),), rounding="nearest")
    (gather,) = prog.graph.nodes_of(Op.GATHER_PARAM)
    assert len(gather.attrs.index) == 64 and set(gather.attrs.index) == set(range(16))
    x = np.random.default_rng(0).standard_normal((8, 4, 4, 4)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


class AffineTokens(nn.Module):
    """ResMLP's affine layer, torch.addcmul(beta, alpha, x) with alpha and beta [1, 1, D], and
    addcmul of activations with a value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.alpha = nn.Parameter(torch.ones(1, 1, 16) * 0.9)
        self.beta = nn.Parameter(torch.full((1, 1, 16), 0.1))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.reshape(x.shape[0], 8, 8))
        t = torch.addcmul(self.beta, self.alpha, t)
        t = torch.addcmul(t, t, torch.sigmoid(t), value=0.5)
        return self.head(t.mean(1))


def test_addcmul_trains_bit_exact_and_matches_torch() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 4)
    _trained_on_every_target(AffineTokens, x, y)
    torch.manual_seed(0)
    model = AffineTokens()
    prog = mexc.compile(model, (torch.zeros(4, 1, 8, 8),), rounding="nearest")
    assert [tuple(n.attrs.view) for n in prog.graph.nodes_of(Op.ADD_PARAM)] == [(1, 1, 16)]
    assert_logits_match_torch(model, prog, x)
    assert_gradients_follow_autograd(model, prog, x, y, ("alpha", "beta"), 0.99)
