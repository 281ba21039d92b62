"""nn.Unfold / F.unfold (im2col) and nn.Fold / F.fold (col2im) as convolutions with a constant
one-hot kernel (mexc.ops.patches; VOLO's outlook attention, TNT): the patches are the input's
mantissas exactly, fold sums them back. Against torch and autograd, bit-exact on reference,
llvm and C, and dilation refused by node."""

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


class Patches(nn.Module):
    """A convolution's map cut into overlapping 3 x 3 patches (stride 2), each patch mixed by
    a linear layer, and folded back onto the map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.unfold = nn.Unfold(3, padding=1, stride=2)
        self.mix = nn.Linear(36, 36)
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 1, 8, 8]
        p = self.unfold(self.conv(x))  # [N, 36, 16]
        p = self.mix(p.transpose(1, 2)).transpose(1, 2)
        y = F.fold(p, (8, 8), 3, padding=1, stride=2)  # [N, 4, 8, 8]
        return self.head(torch.relu(y).flatten(1))


def _model() -> Patches:
    torch.manual_seed(0)
    return Patches()


class _Map(nn.Module):
    def __init__(self, patches: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.patches = patches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return (F.unfold(y, (3, 2), padding=(1, 0), stride=(2, 1)) if self.patches else y).flatten(
            1
        )


def test_the_patches_are_the_maps_values_exactly() -> None:
    x = small_batch((4, 1, 8, 8))[0]
    maps = []
    for patches in (False, True):
        torch.manual_seed(0)
        prog = mexc.compile(_Map(patches), (torch.zeros(4, 1, 8, 8),), rounding="nearest")
        maps.append(prog.logits(x))
    want = F.unfold(
        torch.from_numpy(maps[0]).view(4, 4, 8, 8), (3, 2), padding=(1, 0), stride=(2, 1)
    )
    np.testing.assert_array_equal(maps[1], want.flatten(1).numpy())


def test_unfold_and_fold_are_a_depthwise_convolution_and_its_transpose() -> None:
    prog = mexc.compile(_model(), (torch.zeros(4, 1, 8, 8),), target="reference")
    forward = [n for n in prog.graph.nodes if prog.graph.is_forward(n)]
    convs = [n for n in forward if n.op is Op.CONV2D_COMPACT]
    assert [int(n.attrs.groups) for n in convs] == [1, 4]
    assert [n.op for n in forward].count(Op.CONV2D_GRAD_INPUT) == 1
    # the one-hot kernels are frontend constants, never trained
    trained = {str(n.attrs.param) for n in prog.graph.nodes_of(Op.SGD_UPDATE)}
    assert trained == {
        "conv.weight",
        "conv.bias",
        "mix.weight",
        "mix.bias",
        "head.weight",
        "head.bias",
    }


def test_logits_match_torch() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 1, 8, 8))[0])


def test_gradients_follow_autograd() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    x, y = small_batch((32, 1, 8, 8))
    assert_gradients_follow_autograd(
        model, prog, x, y, ("conv.weight", "mix.weight", "head.weight"), 0.97
    )


def test_trains_bit_exact_on_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        return mexc.compile(_model(), (torch.zeros(4, 1, 8, 8),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program)


class _Dilated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.unfold(self.conv(x), 3, dilation=2).mean(-1)


def test_dilated_patches_are_refused_by_node() -> None:
    with pytest.raises(UnsupportedOpError, match="dilation") as err:
        mexc.compile(_Dilated(), (torch.zeros(4, 1, 8, 8),), target="reference")
    assert "test_patches.py" in str(err.value)
