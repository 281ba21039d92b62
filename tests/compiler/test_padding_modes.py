"""Reflect, replicate and circular padding (F.pad, the ReflectionPad / ReplicationPad /
CircularPad modules, and Conv1d / Conv2d padding_mode) and padding="same" / "valid": slices of
the copied rows concatenated around the input, exact copies of torch's rows; their gradients
sum back into the rows they copy; a model with each trains bit-exact on reference, llvm and C
(their slice and concat kernels are the CUDA backend's, emulated in test_zoo_ops)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    small_batch,
    step_values,
    train_checksums,
)


class PadThenLinear(nn.Module):
    def __init__(self, pads: tuple[int, ...], mode: str, features: int) -> None:
        super().__init__()
        self.pads, self.mode = pads, mode
        self.fc = nn.Linear(features, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.pad(x, self.pads, mode=self.mode), 1))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize(
    ("shape", "pads"),
    [
        ((2, 3, 5, 6), (1, 1, 1, 1)),
        ((2, 3, 5, 6), (2, 0, 1, 3)),
        ((2, 3, 5, 6), (3, 2, 0, 0)),
        ((2, 3, 5, 6), (-1, 2, 1, -2)),
        ((2, 4, 7), (2, 3)),
    ],
)
def test_padded_rows_are_torchs(mode: str, shape: tuple[int, ...], pads: tuple[int, ...]) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    xq = torch.from_numpy(K.quantize(x.astype(np.float64), 8).dequantize())
    want = F.pad(xq, pads, mode=mode)
    model = PadThenLinear(pads, mode, int(np.prod(want.shape[1:])))
    prog = mexc.compile(model, (torch.from_numpy(x),))
    values = step_values(prog, x, np.zeros(shape[0], np.int64))
    (fc,) = prog.graph.nodes_of(Op.LINEAR_COMPACT)
    got = values[fc.inputs[0]].dequantize().reshape(want.shape)
    np.testing.assert_array_equal(got, want.numpy())


class PaddingModesNet(nn.Module):
    """Each padding mode of Conv2d, padding="same" with an even kernel (uneven zero padding),
    a Conv1d with padding "same" in mode reflect, and the padding modules."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect")
        self.c2 = nn.Conv2d(4, 4, 3, padding=2, padding_mode="replicate")
        self.c3 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.c4 = nn.Conv2d(4, 4, 4, padding="same")
        self.c5 = nn.Conv1d(4, 4, 3, padding="same", padding_mode="reflect")
        self.pad = nn.ReflectionPad2d((1, 2, 0, 1))
        self.fc = nn.Linear(4 * 11 * 14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c4(F.relu(self.c3(self.c2(F.relu(self.c1(x))))))
        n, c, h, w = x.shape
        x = self.c5(x.reshape(n, c, h * w)).reshape(n, c, h, w)
        x = F.pad(self.pad(x), (1, 0, 0, 0), mode="replicate")
        return self.fc(torch.flatten(x, 1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(PaddingModesNet(), (torch.zeros(4, 1, 8, 8),), target=target, bits=bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    convs = list(ref.graph.nodes_of(Op.CONV2D_COMPACT))
    assert [tuple(n.attrs.padding) for n in convs] == [(0, 0)] * 5
    assert_trains_bit_exact_on_llvm_and_c(ref, lambda t: _program(t, bits))


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = PaddingModesNet()
    prog = mexc.compile(model, (torch.zeros(16, 1, 8, 8),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((16, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


class ConvPadLinear(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 10 * 10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.pad(self.conv(x), (1, 1, 1, 1), mode=self.mode), 1))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_gradients_through_the_padding_match_autograd(mode: str) -> None:
    """The convolution before the padding learns from the copied rows' gradients summed back
    (batch 64, nearest rounding): its weight's gradient has cosine >= 0.999 with torch's. Its
    bias's, a sum over 4,096 positions of gradients whose exponent the summed edge rows raise,
    >= 0.95 (measured 0.957 to 0.969; with zero padding, whose gradient is a plain slice,
    0.9999)."""
    torch.manual_seed(0)
    model = ConvPadLinear(mode)
    prog = mexc.compile(model, (torch.zeros(64, 1, 8, 8),), rounding="nearest")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    ints, floats = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(ints["conv.weight"], floats["conv.weight"]) >= 0.999
    assert cosine(ints["conv.bias"], floats["conv.bias"]) >= 0.95


class PadWith(nn.Module):
    def __init__(self, pads: tuple[int, ...], value: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4 * 5, 10)
        self.pads, self.value = pads, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.pad(x, self.pads, value=self.value), 1))


def test_padding_with_a_value_adds_it_where_the_padding_is() -> None:
    torch.manual_seed(0)
    model = PadWith((1, 1), 1.0)
    prog = mexc.compile(model, (torch.zeros(8, 4, 3),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 4, 3))[0], rel=0.02)


@pytest.mark.parametrize(
    ("pads", "value"), [((3, -1), 1.0), ((1, 1), float("inf")), ((1, 1), -1e4)]
)
def test_a_crop_with_a_value_or_an_infinite_or_large_value_is_refused(
    pads: tuple[int, ...], value: float
) -> None:
    with pytest.raises(UnsupportedOpError, match="'reflect', 'replicate' and 'circular'"):
        mexc.compile(PadWith(pads, value), (torch.zeros(2, 4, 3),))


def test_a_crop_that_leaves_too_few_rows_to_reflect_is_refused() -> None:
    """F.pad(x, (-3, 3), "reflect") on 6 rows: torch reflects 3 rows of the 3 the crop
    leaves, reading rows it cropped; mexc names it (every other crop and pad of -3..3 in the
    three modes on 6 rows equals torch's rows: 142 cases, checked by hand on 2026-12-05)."""
    model = PadThenLinear((-3, 3), "reflect", 3 * 6)
    with pytest.raises(UnsupportedOpError, match="more rows than the crop leaves"):
        mexc.compile(model, (torch.zeros(2, 3, 6),))


class SamePool(nn.Module):
    """TF's "same" max pooling as timm's MaxPool2dSame writes it: F.pad with -inf, then
    F.max_pool2d (or a MaxPool2d module) without padding of its own; `mode` "replicate" pads
    with the edge's value instead."""

    def __init__(self, pads: tuple[int, ...], kernel: int, module: bool, mode: str) -> None:
        super().__init__()
        self.pads, self.kernel, self.mode = pads, kernel, mode
        self.conv = nn.Conv2d(3, 8, 3)  # 9 x 9 -> 7 x 7
        self.pool = nn.MaxPool2d(kernel, 2) if module else None
        h = (7 + pads[2] + pads[3] - kernel) // 2 + 1 if len(pads) == 4 else (7 - kernel) // 2 + 1
        w = (7 + pads[0] + pads[1] - kernel) // 2 + 1
        self.fc = nn.Linear(8 * h * w, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.mode == "replicate":
            x = F.pad(x, (*self.pads, 0, 0)[:4], mode="replicate")  # 4-D: both axes
        else:
            x = F.pad(x, self.pads, value=float("-inf"))
        x = self.pool(x) if self.pool is not None else F.max_pool2d(x, self.kernel, 2)
        return self.fc(x.flatten(1))


def _same_pool(
    pads: tuple[int, ...], kernel: int, module: bool = False, mode: str = "constant"
) -> tuple[nn.Module, mexc.Program]:
    torch.manual_seed(0)
    model = SamePool(pads, kernel, module, mode)
    return model, mexc.compile(model, (torch.zeros(2, 3, 9, 9),))


@pytest.mark.parametrize("module", [False, True])
@pytest.mark.parametrize(("pads", "kernel"), [((0, 1, 0, 1), 3), ((1, 2, 2, 1), 3), ((0, 1), 2)])
def test_padding_with_minus_infinity_before_max_pooling_is_replicate_padding(
    pads: tuple[int, ...], kernel: int, module: bool
) -> None:
    """Every window that reads the padding also reads the edge, so the maxima and their
    gradients are those of replicate padding: the same training, bit for bit, and torch's
    logits (which pad with -inf)."""
    model, same = _same_pool(pads, kernel, module)
    _, rep = _same_pool(pads, kernel, module, "replicate")
    batch = small_batch((2, 3, 9, 9))
    assert_logits_match_torch(model, same, batch[0])
    assert train_checksums(same, batch, 2) == train_checksums(rep, batch, 2)


def test_padding_with_minus_infinity_elsewhere_is_refused() -> None:
    """A pad as wide as the window (a window of padding alone: -inf in torch) keeps the
    refusal of large constants, naming the value."""
    for pads in [(0, 3, 0, 3), (3, 0, 0, 0)]:
        with pytest.raises(UnsupportedOpError, match="-inf"):
            _same_pool(pads, 3)
