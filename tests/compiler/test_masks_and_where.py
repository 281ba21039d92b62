"""Comparisons of activations as masks of 0 and 1 (relu(d) / d of the difference, detached),
torch.where, logical ops, Hardshrink, and x.detach() (a view no gradient flows through).
Against torch and autograd, bit-exact on reference, llvm and C."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from mexc.kernels import div_forward
from mexc.mx import MX, RoundCtx
from tests.compiler.helpers import (
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    dequantized_copy,
    float_gradients,
    integer_gradients,
    small_batch,
)


def test_the_mask_of_a_difference_is_exactly_zero_and_one() -> None:
    d = MX(np.array([[-128, -3, -1, 0, 1, 2, 127]], np.int8), np.array(-4, np.int32))
    relu = MX(np.maximum(d.m, 0).astype(np.int8), d.e)
    m = div_forward(relu, d, RoundCtx("stochastic", 0, 0, 8), 0)
    np.testing.assert_array_equal(m.dequantize(), [[0, 0, 0, 0, 1, 1, 1]])


class Masks(nn.Module):
    """Continuous uses of masks (a leaky ReLU and a clip written with where, a mask times its
    own difference) and discontinuous ones (Hardshrink, a product with a mask of another
    layer's comparison), and a detached branch."""

    def __init__(self, continuous: bool = True) -> None:
        super().__init__()
        self.continuous = continuous
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.gate = nn.Linear(32, 32)
        self.shrink = nn.Hardshrink(0.25)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = torch.where(h > 0, h, 0.1 * h)  # a leaky ReLU written with where
        h = torch.where(h <= 1.0, h, 1.0) + (h - 2.0) * (h > 2.0)
        g = self.gate(h)
        if not self.continuous:
            keep = (g >= h) & ~(g > 2.0) | (h != 0).logical_not()
            h = self.shrink(h * keep.float()) + F.hardshrink(h, 0.5)
        return self.head(self.fc2(h) + g.detach())


def _model(continuous: bool = True) -> Masks:
    torch.manual_seed(0)
    return Masks(continuous)


def test_the_masks_are_divisions_and_where_products() -> None:
    prog = mexc.compile(_model(False), (torch.zeros(4, 16),), target="reference")
    ops = [n.op for n in prog.graph.nodes if prog.graph.is_forward(n)]
    # h > 0, h <= 1, h > 2, g >= h, g > 2, h != 0 (two), two shrinks
    assert ops.count(Op.DIV) == 9
    assert Op.DETACH in [n.op for n in prog.graph.nodes]


def test_logits_match_torch() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(16, 16),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((16, 16))[0])


def test_the_masks_agree_with_torchs_on_all_but_near_ties() -> None:
    """Discontinuous: an element within the rounding of a threshold may fall either side, so
    the logits of the whole model are compared by how many agree closely."""
    model = _model(False)
    prog = mexc.compile(model, (torch.zeros(64, 16),), rounding="nearest")
    x = small_batch((64, 16))[0]
    ref = dequantized_copy(model, prog).eval()
    want = ref(torch.from_numpy(mexc.kernels.quantize(x.astype(np.float64), 8).dequantize()))
    close = np.abs(prog.logits(x) - want.detach().numpy()) <= 0.05 * float(want.abs().max())
    assert close.mean() >= 0.9, close.mean()


def test_gradients_follow_autograd() -> None:
    model = _model(False)
    prog = mexc.compile(model, (torch.zeros(64, 16),))
    x, y = small_batch((64, 16))
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert "gate.weight" not in got  # read only through a mask and a detach: torch's is None
    for name in ("fc1.weight", "fc2.weight", "head.weight"):
        assert cosine(got[name], want[name]) >= 0.95, (name, cosine(got[name], want[name]))


def test_trains_bit_exact_on_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        return mexc.compile(_model(False), (torch.zeros(4, 16),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, small_batch((4, 16)))


class _Detached(nn.Module):
    """Only the head trains through h: fc's gradient comes from the other path alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.side = nn.Linear(16, 10)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(h.detach()) + self.side(h)


def test_no_gradient_flows_back_through_detach() -> None:
    torch.manual_seed(0)
    model = _Detached()
    prog = mexc.compile(model, (torch.zeros(32, 16),))
    x, y = small_batch((32, 16))
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(got["fc.weight"], want["fc.weight"]) >= 0.99


class _IndexWhere(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h + torch.where(h > 0)[0].sum()


def test_where_without_values_is_refused_by_node() -> None:
    with pytest.raises(UnsupportedOpError) as err:
        mexc.compile(_IndexWhere(), (torch.zeros(4, 16),), target="reference")
    assert "test_masks_and_where.py" in str(err.value)


class _Probe(nn.Module):
    def __init__(self, body: object) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 16)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.fc(x), self.gate(x))  # type: ignore[operator]


def test_a_pairs_complementary_masks_are_exactly_complementary() -> None:
    """`>` and `<=` (and `==`, `!=`) of one pair read one rounded difference, so they never
    both hold, also with stochastic rounding."""

    def body(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (h > g).float() + (g >= h).float() + (h == g).float() + (g != h).float()

    torch.manual_seed(0)
    prog = mexc.compile(_Probe(body), (torch.zeros(64, 16),), target="reference")
    np.testing.assert_array_equal(prog.logits(small_batch((64, 16))[0]), 2.0)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (lambda h, g: torch.where(h > 0, h, -1e4), "at most 8 in size"),
        (lambda h, g: torch.logical_not(h), "not boolean"),
        (lambda h, g: (h > 0) + (g > 0), "adds two masks"),
        (lambda h, g: h > float("inf"), "finite numbers"),
    ],
)
def test_fills_beyond_8_logical_ops_of_floats_and_sums_of_masks_are_refused(
    body: object, says: str
) -> None:
    with pytest.raises(UnsupportedOpError, match=says) as err:
        mexc.compile(_Probe(body), (torch.zeros(4, 16),), target="reference")
    assert "test_masks_and_where.py" in str(err.value)


class _CombinedThenFirst(nn.Module):
    """m1 & m2 and m1 | m2, then m1 read again: Python's operators change neither operand."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        m1, m2 = h > 0, h < 0.3
        both, either = m1 & m2, m1 | m2
        return self.head(h * m1 + h * both * 2.0 + either * 0.5)


def test_logical_operators_leave_their_operands_as_they_were() -> None:
    torch.manual_seed(0)
    model = _CombinedThenFirst()
    prog = mexc.compile(model, (torch.zeros(16, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((16, 8))[0], rel=0.05)


class _ConstantCondition(nn.Module):
    """A constant mask (a tril buffer's comparison) in masked_fill with 0 and in torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)
        self.register_buffer("tril", torch.tril(torch.ones(8, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        outer = (h[:, :, None] * h[:, None, :]).masked_fill(self.tril == 0, 0.0)
        return self.head(outer.sum(1) + torch.where(self.tril[0] > 0.5, h, -1.0))


def test_a_constant_condition_is_a_constant_mask() -> None:
    torch.manual_seed(0)
    model = _ConstantCondition()
    prog = mexc.compile(model, (torch.zeros(16, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((16, 8))[0], rel=0.05)
