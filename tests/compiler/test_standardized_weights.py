"""Weight standardization (timm's StdConv2d and ScaledStdConv2d: BiT, NFNets): each output
channel's row of a convolution's weight normalized every step, as a GroupNorm of the weight
with a group per row (ops.norm._standardized_weight), its gradient passed back through the norm
to the parameter. Against torch's logits and autograd's gradients, bit-exact on reference, llvm
and C, and on the CUDA emulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.layers import ScaledStdConv2d, StdConv2d
from torch import nn

import mexc
from mexc.backends.llvm import float_check
from mexc.backends.llvm.step import LlvmProgram
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    small_batch,
)


class Standardized(nn.Module):
    """BiT's StdConv2d, an NFNet's ScaledStdConv2d (a gain per output channel times a number,
    with a bias and a stride), a grouped one, and one written out with F.batch_norm's
    positional arguments and view_as."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = StdConv2d(1, 8, 3, padding=1, bias=False)
        self.down = ScaledStdConv2d(8, 16, 3, stride=2, padding=1)
        self.grouped = ScaledStdConv2d(16, 16, 3, padding=1, groups=4, gamma=1.7)
        self.weight = nn.Parameter(torch.randn(16, 16, 1, 1) * 0.3 + 0.1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.down(x))
        x = F.relu(self.grouped(x))
        w = F.batch_norm(self.weight.view(1, 16, -1), None, None, None, None, True, 0.0, 1e-5)
        x = F.conv2d(x, w.view_as(self.weight))
        return self.head(x.mean((2, 3)))


def _program(target: str = "reference", batch: int = 4) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Standardized(), (torch.zeros(batch, 1, 8, 8),), target=target)


def test_each_weight_is_standardized_every_step_as_torch_does() -> None:
    prog = _program()
    copies = [n.type.shape for n in prog.graph.nodes_of(Op.EXPAND_PARAM) if not n.attrs.over_batch]
    # one copy of each standardized weight and of each gain times a number, not one per sample
    assert sorted(copies) == [
        (1, 8, 1, 3, 3),
        (1, 16),
        (1, 16),
        (1, 16, 4, 3, 3),
        (1, 16, 8, 3, 3),
        (1, 16, 16, 1, 1),
    ]
    rows = sorted(int(n.attrs.groups) for n in prog.graph.nodes_of(Op.LAYERNORM))
    assert rows == [8, 16, 16, 16]  # a group per output channel
    torch.manual_seed(0)
    assert_logits_match_torch(Standardized(), prog, small_batch()[0], rel=0.1)


def test_gradients_pass_through_the_standardization_to_the_parameters() -> None:
    torch.manual_seed(0)
    model = Standardized()
    prog = mexc.compile(model, (torch.zeros(4, 1, 8, 8),))
    x, y = small_batch()
    names = ["stem.weight", "down.weight", "down.gain", "down.bias", "grouped.weight"]
    assert_gradients_follow_autograd(model, prog, x, y, [*names, "weight", "head.weight"], 0.97)


def test_the_float_weights_come_back_in_the_model_shapes() -> None:
    prog = _program()
    prog.step(*small_batch())
    weights = prog.float_weights()
    assert weights["down.gain"].shape == (16, 1, 1, 1)  # held as a row of 16
    model = Standardized()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    assert np.array_equal(model.down.gain.detach().numpy(), weights["down.gain"])


def test_trains_bit_exact_on_reference_llvm_and_c_integer_only() -> None:
    built: list[mexc.Program] = []

    def program(target: str) -> mexc.Program:
        built.append(_program(target))
        return built[-1]

    assert_trains_bit_exact_on_llvm_and_c(_program(), program, small_batch())
    llvm = built[0]
    assert isinstance(llvm, LlvmProgram)
    float_check.check_integer_only(llvm)  # raises, naming each float instruction, if any


def test_the_cuda_source_trains_bit_exact_on_the_emulator(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program(), tmp_path)


class Forms(nn.Module):
    """A gain times a number written as a method and as a quotient, and timm's
    ScaledStdConv2d with padding="same" (F.conv2d's string padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = ScaledStdConv2d(1, 4, 3, padding="same")
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, 4).view(4, 1, 1, 1))
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv.weight.reshape(1, 4, -1)
        halved = F.batch_norm(w, None, None, self.g.mul(0.5).view(-1), None, True, 0.0, 1e-5)
        thirds = F.batch_norm(w, None, None, (self.g / 3.0).view(-1), None, True, 0.0, 1e-5)
        y = self.conv(x) + F.conv2d(x, halved.view_as(self.conv.weight), padding=1)
        y = y + F.conv2d(x, thirds.view_as(self.conv.weight), padding="same")
        return self.head(F.relu(y).mean((2, 3)))


def test_gain_forms_and_same_padding_follow_torch() -> None:
    torch.manual_seed(0)
    model = Forms()
    prog = mexc.compile(model, (torch.zeros(4, 1, 8, 8),))
    x, y = small_batch()
    assert_logits_match_torch(model, prog, x, rel=0.05)
    assert_gradients_follow_autograd(model, prog, x, y, ["conv.weight", "conv.gain", "g"], 0.97)


HEAD = ["head.bias", "head.weight", "weight"]  # the written-out conv's weight, then the head


@pytest.mark.parametrize(
    ("spec", "trained"),
    [
        ("last:2", ["head.bias", "head.weight", "weight"]),
        ("last:3", ["grouped.bias", "grouped.gain", "grouped.weight", *HEAD]),
        ("bias-norm", ["down.bias", "down.gain", "grouped.bias", "grouped.gain", "head.bias"]),
    ],
)
def test_a_standardized_convolution_is_one_weight_layer(spec: str, trained: list[str]) -> None:
    """trainable="last:K" counts a standardized convolution as the layer that reads its
    weight, its gain as that layer's norm affine (not as the copies that compute them)."""
    torch.manual_seed(0)
    prog = mexc.compile(Standardized(), (torch.zeros(4, 1, 8, 8),), trainable=spec)
    assert sorted(str(n.attrs.param) for n in prog.graph.nodes_of(Op.SGD_UPDATE)) == trained


class FromInput(nn.Module):
    """A convolution whose weight is computed from the input, not from parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.conv2d(x, x[:, :, :3, :3], padding=1).mean((2, 3)))


class WithRunningStatistics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv.weight.reshape(1, 4, -1)
        w = F.batch_norm(w, self.mean, self.var, training=True, momentum=0.1).reshape_as(
            self.conv.weight
        )
        return self.head(F.conv2d(x, w).mean((2, 3)))


class OverInputChannels(nn.Module):
    """A weight normalized over each input channel (transposed before the reshape)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv.weight.transpose(0, 1).reshape(1, 2, -1)
        w = F.batch_norm(w, None, None, training=True).reshape(2, 4, 3, 3).transpose(0, 1)
        return self.head(F.conv2d(x.repeat(1, 2, 1, 1), w).mean((2, 3)))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (OverInputChannels, r"node 'batch_norm' .* normalizes a rearranged parameter"),
        (FromInput, r"node 'getitem' .* at test_standardized_weights.py:\d+ is used as a layer's"),
        (WithRunningStatistics, r"node 'batch_norm' .* other than weight standardization's"),
    ],
)
def test_other_computed_weights_are_refused_by_node(model: type, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=message):
        mexc.compile(model(), (torch.zeros(2, 1, 8, 8),))
