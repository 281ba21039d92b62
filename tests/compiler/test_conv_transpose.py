"""Transposed convolutions (nn.ConvTranspose2d / 1d, F.conv_transpose2d / 1d) as the
convolution's dx product in the forward graph, their gradients the convolution's other two
products (docs/layers.md). Against torch and autograd, bit-exact on reference, llvm, C and the
CUDA emulator, and the layers mexc cannot take refused by node."""

from __future__ import annotations

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
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    small_batch,
    train_checksums,
)
from tests.compiler.test_hardswish import needs_cuda_tools


class UpNet(nn.Module):
    """A small U-Net: a strided up-convolution with bias back to the skip's size, a grouped
    one without bias (kernel 4, stride 2, padding 1), one with output_padding, and a 1-D one
    over the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 8, 3, padding=1)
        self.mid = nn.Conv2d(8, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.fuse = nn.Conv2d(16, 8, 3, padding=1)
        self.grouped = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1, groups=2, bias=False)
        self.odd = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.rows = nn.ConvTranspose1d(4, 2, 3, stride=2)
        self.head = nn.Linear(2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 1, 8, 8]
        a = F.relu(self.down(x))
        b = F.relu(self.mid(F.max_pool2d(a, 2)))  # [N, 16, 4, 4]
        y = F.relu(self.fuse(torch.cat([self.up(b), a], 1)))  # [N, 8, 8, 8]
        y = F.relu(self.odd(F.max_pool2d(self.grouped(F.max_pool2d(y, 2)), 2)))  # [N, 4, 8, 8]
        r = self.rows(y.mean(2))  # [N, 2, 17]
        return self.head(r.mean(2))


def _program(target: str = "reference", batch: int = 4, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(UpNet(), (torch.zeros(batch, 1, 8, 8),), target=target, **kw)


def test_each_layer_is_the_convolutions_dx_product() -> None:
    g = _program().graph
    ops = [n.op for n in g.nodes]
    ups = [n for n in g.nodes if n.op is Op.CONV2D_GRAD_INPUT]
    assert len(ups) == 4 + 2  # the 4 layers, and the dx of the 2 convolutions that need one
    # their gradients: a weight gradient each (with the 3 convolutions'), and dx as a
    # convolution of dy with the weight (with the 3 forward convolutions and the 4 up ones)
    assert ops.count(Op.CONV2D_GRAD_WEIGHT) == 7
    assert ops.count(Op.CONV2D_COMPACT) == 3 + 4


def test_logits_match_torch() -> None:
    torch.manual_seed(0)
    model = UpNet()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 1, 8, 8))[0])


def test_gradients_follow_autograd() -> None:
    torch.manual_seed(0)
    model = UpNet()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    x, y = small_batch((32, 1, 8, 8))
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    names = ("up.weight", "up.bias", "grouped.weight", "odd.weight", "rows.weight", "down.weight")
    for name in names:
        assert cosine(got[name], want[name]) >= 0.95, (name, cosine(got[name], want[name]))


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    batch = small_batch((4, 1, 8, 8))
    assert_trains_bit_exact_on_llvm_and_c(_program(), lambda t: _program(t), batch)


def test_every_node_at_its_leanest_trains_bit_exact() -> None:
    """The layers' lean forms (the dx product's chunks and scans) on the host and GPU plans."""
    from mexc.backends.llvm.step import LlvmProgram
    from mexc.lowering.step_plan import leanest

    x, y = small_batch((4, 1, 8, 8))
    ref = _program()
    want = train_checksums(ref, (x, y))
    for device in ("cpu", "gpu"):
        lean = leanest(ref, device)
        prog = LlvmProgram(_program().retargeted("llvm"), plan_device=device, lean=lean)
        assert train_checksums(prog, (x, y)) == want, device


@needs_cuda_tools
@pytest.mark.slow
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program(), tmp_path)


class _Dilated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(1, 2, 3, dilation=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x).mean((2, 3))


class _ScaledWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, 2, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(x, self.w * 2).mean((2, 3))


@pytest.mark.parametrize(
    ("model", "message"),
    [(_Dilated, "with dilation"), (_ScaledWeight, "uses as an activation")],
)
def test_what_mexc_cannot_take_is_refused_by_node(model, message: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(model(), (torch.zeros(4, 1, 8, 8),))
    assert "test_conv_transpose.py" in str(err.value)


def test_the_functional_form_trains_as_the_module() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(1, 3, 2, stride=2)
            self.head = nn.Linear(3, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.conv_transpose2d(x, self.up.weight, self.up.bias, stride=2)
            return self.head(F.relu(y).mean((2, 3)))

    class Module(Functional):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(F.relu(self.up(x)).mean((2, 3)))

    x, y = small_batch((4, 1, 8, 8))
    sums = []
    for cls in (Functional, Module):
        torch.manual_seed(0)
        prog = mexc.compile(cls(), (torch.zeros(4, 1, 8, 8),))
        losses = [prog.step(x, y) for _ in range(2)]
        sums.append((losses, prog.state_checksum()))
    assert sums[0] == sums[1]
    assert np.isfinite(sums[0][0]).all()


def test_the_1d_functional_form_trains_as_the_module() -> None:
    """F.conv_transpose1d with the layer's weight is the layer: the same bits, step after step."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1)
            self.head = nn.Linear(3, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.conv_transpose1d(
                x.flatten(2), self.up.weight, self.up.bias, 2, 1, output_padding=1
            )
            return self.head(F.relu(y).mean(2))

    class Module(Functional):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(F.relu(self.up(x.flatten(2))).mean(2))

    x, y = small_batch((4, 2, 2, 4))
    sums = []
    for cls in (Functional, Module):
        torch.manual_seed(0)
        model = cls()
        prog = mexc.compile(model, (torch.zeros(4, 2, 2, 4),), rounding="nearest")
        assert [n.op for n in prog.graph.nodes].count(Op.CONV2D_GRAD_INPUT) == 1
        assert_logits_match_torch(model, prog, x)
        losses = [prog.step(x, y) for _ in range(2)]
        sums.append((losses, prog.state_checksum()))
    assert sums[0] == sums[1]


def test_a_convolution_and_its_transpose_sharing_a_weight_train_it_once() -> None:
    """dec.weight = enc.weight (a tied autoencoder): one parameter whose gradient is the sum of
    both layers', as torch's; held as a (O, C, 1, k) kernel, the tie is found through the view."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Conv1d(2, 4, 3)
            self.dec = nn.ConvTranspose1d(4, 2, 3)
            self.dec.weight = self.enc.weight
            self.fc = nn.Linear(2, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.dec(F.relu(self.enc(x))).mean(2))

    torch.manual_seed(0)
    model = Tied()
    prog = mexc.compile(model, (torch.zeros(16, 2, 8),))
    assert "dec.weight" not in prog.state and "enc.weight" in prog.state
    x, y = small_batch((16, 2, 8))
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(got["enc.weight"], want["enc.weight"]) >= 0.99
