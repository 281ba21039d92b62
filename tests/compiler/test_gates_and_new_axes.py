"""GLU (nn.GLU, F.glu), the elementwise maximum and minimum of two activations
(torch.maximum, torch.max(a, b), minimum), narrow, and reads that insert axes with None
(`w[:, :, None, None]`, a squeeze-and-excitation gate; `x[..., None]`): slices, the integer
sigmoid, product, sums and ReLU, and a reshape. Against torch and autograd, bit-exact on
reference, llvm and C, and what mexc cannot take refused by node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    small_batch,
)


class GatedNet(nn.Module):
    """A convolution gated by GLU over its channels, a squeeze-and-excitation gate (of rows
    narrowed) read as w[:, :, None, None], F.glu on features widened with x[..., None], and
    the elementwise maximum and minimum of two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.glu = nn.GLU(dim=1)
        self.se = nn.Linear(8, 8)
        self.fc = nn.Linear(8 * 16, 20)
        self.mix = nn.Linear(2, 1)
        self.head = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 1, 8, 8]
        y = self.glu(self.conv(x))  # [N, 8, 8, 8]
        w = torch.sigmoid(self.se(y.narrow(2, 1, 6).mean((2, 3))))  # rows 1 to 6
        y = F.avg_pool2d(y * w[:, :, None, None], 2)  # [N, 8, 4, 4]
        h = F.glu(input=self.fc(y.flatten(1)), dim=-1)  # [N, 10]
        pair = torch.cat([h[..., None], h[:, None].transpose(1, 2) * 0.5], -1)  # [N, 10, 2]
        m = self.mix(pair)[..., 0]
        return self.head(torch.maximum(input=h, other=m) + torch.min(h, -m) + torch.max(h, m) / 2)


def _program(target: str = "reference", batch: int = 4, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(GatedNet(), (torch.zeros(batch, 1, 8, 8),), target=target, **kw)


def test_glu_is_a_sigmoid_gate_of_two_slices_and_the_extremes_relus() -> None:
    ops = [n.op for n in _program().graph.nodes]
    assert ops.count(Op.SIGMOID) == 3  # two GLUs and the SE gate
    assert ops.count(Op.SLICE) >= 4  # the halves of each GLU
    assert ops.count(Op.RELU) == 3  # relu(a - b) of each maximum and of the minimum


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = GatedNet()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 1, 8, 8))[0])


def test_gradients_follow_autograd() -> None:
    torch.manual_seed(0)
    model = GatedNet()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    x, y = small_batch((32, 1, 8, 8))
    assert_gradients_follow_autograd(
        model,
        prog,
        x,
        y,
        ("conv.weight", "se.weight", "fc.weight", "mix.weight", "head.weight"),
        0.97,
    )


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    batch = small_batch((4, 1, 8, 8))
    assert_trains_bit_exact_on_llvm_and_c(_program(), lambda t: _program(t), batch)


class _GluOverBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.glu(self.fc(x), 0)


class _BroadcastMaximum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return torch.maximum(y, y.mean(1, keepdim=True))


class _WriteWithNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)[:, None]
        y[:, None, 0] = 1.0
        return y[:, 0]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_GluOverBatch, "along the batch axis"),
        (_BroadcastMaximum, "not two activations of the result's shape"),
        (_WriteWithNone, r"one Ellipsis \(not a tensor"),
    ],
)
def test_what_mexc_cannot_take_is_refused_by_node(model, message: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(model(), (torch.zeros(4, 8),))
    assert "test_gates_and_new_axes.py" in str(err.value)  # the model's source line


def test_an_axis_inserted_before_the_batch_trains() -> None:
    """x[None] puts the batch on axis 1; summing the new axis away gives it back."""

    class Lead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)[None].sum(0)

    torch.manual_seed(0)
    model = Lead()
    prog = mexc.compile(model, (torch.zeros(4, 8),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)
    loss = prog.step(x, np.arange(4))
    assert np.isfinite(loss)


class _Minima(nn.Module):
    """torch.min over an axis (values), amin over two, and the method forms."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        low = torch.min(h.flatten(2), 2).values + h.amin((2, 3)) / 2
        return self.fc(low + h.min(dim=-1, keepdim=True)[0].mean((2, 3)))


def test_minima_over_axes_are_negated_maxima_and_match_torch() -> None:
    torch.manual_seed(0)
    model = _Minima()
    prog = mexc.compile(model, (torch.zeros(8, 3, 8, 8),), rounding="nearest")
    assert [n.op for n in prog.graph.nodes].count(Op.MAXPOOL2D) == 3
    x, y = small_batch((8, 3, 8, 8))
    assert_logits_match_torch(model, prog, x, rel=0.03)
    assert_gradients_follow_autograd(model, prog, x, y, ("conv.weight", "fc.weight"), 0.95)
