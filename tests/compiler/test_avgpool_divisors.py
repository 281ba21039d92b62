"""Average pooling whose windows torch divides by fewer elements than kh kw
(count_include_pad=False at the borders: PoolFormer; ceil_mode windows past the input: timm's
ResNet-D downsampling at odd sizes) or by divisor_override: the pool, then a constant map of
kh kw / divisor; against torch, and bit-exact on reference, llvm and C. And GroupNorm over
(N, C, 1, 1) (PoolFormer's head)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.ir import Op
from mexc.ops.pool import torch_divisors
from tests.compiler.helpers import (
    assert_trains_bit_exact_on_llvm_and_c,
    step_values,
)

CASES = [
    # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, input size
    (3, 1, 1, False, False, None, (7, 6)),
    (2, 2, 0, True, False, None, (7, 7)),
    (3, 2, 1, True, True, None, (8, 7)),
    (3, 2, 1, True, False, None, (6, 9)),
    (2, 2, 0, False, True, 3, (6, 6)),
    (5, 1, 2, False, False, None, (5, 5)),
]


@pytest.mark.parametrize(("k", "s", "p", "ceil", "include", "override", "size"), CASES)
def test_divisors_are_torchs(
    k: int, s: int, p: int, ceil: bool, include: bool, override: int | None, size: tuple
) -> None:
    """torch_divisors against torch itself: the sum of each window of ones over the average."""
    ones = torch.ones(1, 1, *size, dtype=torch.float64)
    avg = F.avg_pool2d(ones, k, s, p, ceil, include, override)
    counts = F.avg_pool2d(ones, k, s, p, ceil, True, 1)  # the in-bounds elements per window
    out = tuple(avg.shape[2:])
    if override is None:
        got = torch_divisors(size, ((k, k), (s, s), (p, p), (0, 0)), include, out)
        np.testing.assert_array_equal(got, (counts / avg)[0, 0].numpy())


class Pools(nn.Module):
    def __init__(self, k: int, s: int, p: int, ceil: bool, include: bool, override: int | None):
        super().__init__()
        self.pool = nn.AvgPool2d(k, s, p, ceil, include, override)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(x), 1)


@pytest.mark.parametrize(("k", "s", "p", "ceil", "include", "override", "size"), CASES)
def test_pooled_values_are_torchs(
    k: int, s: int, p: int, ceil: bool, include: bool, override: int | None, size: tuple
) -> None:
    """Within the two roundings (the pool's and the ratio's product's): 1.5 units of the
    result."""
    pool = Pools(k, s, p, ceil, include, override)
    x = np.random.default_rng(k + s).standard_normal((2, 3, *size)).astype(np.float32)
    xq = torch.from_numpy(K.quantize(x.astype(np.float64), 8).dequantize())
    want = pool(xq).numpy()
    model = nn.Sequential(pool, nn.Linear(want.shape[1], 4))
    prog = mexc.compile(model, (torch.from_numpy(x),), rounding="nearest")
    (fc,) = prog.graph.nodes_of(Op.LINEAR_COMPACT)
    got = step_values(prog, x, np.zeros(2, np.int64))[fc.inputs[0]]
    unit = 2.0 ** float(got.e)
    assert np.abs(got.dequantize().reshape(want.shape) - want).max() <= 1.5 * unit


class Downsample(nn.Module):
    """PoolFormer's token mixer pool(x) - x, a ResNet-D shortcut (ceil_mode, not counting
    padding) at an odd size, a divisor override, GroupNorm(1, C) over a 1 x 1 map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 2)  # 8 x 8 -> 7 x 7
        self.mix = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.down = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
        self.conv2 = nn.Conv2d(8, 8, 1)
        self.norm = nn.GroupNorm(1, 8)
        self.fc = nn.Linear(8 + 8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        y = y + self.mix(y) - y
        d = self.conv2(self.down(y))  # 4 x 4
        g = self.norm(F.avg_pool2d(d, 2, divisor_override=2).mean((2, 3), keepdim=True))
        return self.fc(torch.cat([torch.flatten(g, 1), torch.flatten(d, 1)], 1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Downsample(), (torch.zeros(4, 1, 8, 8),), target=target, bits=bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    views = [tuple(n.attrs.view) for n in ref.graph.nodes_of(Op.MUL)]
    assert views.count((1, 1, 7, 7)) >= 1 and views.count((1, 1, 4, 4)) >= 1
    assert not any(ref.state[k].m.size == 0 for k in ref.state)
    assert_trains_bit_exact_on_llvm_and_c(ref, lambda t: _program(t, bits))
    # the divisor maps are constants held at 8 bits (exact ratios 1, 1.5, 2.25 even at B = 4),
    # unchanged by training
    ratios = set(np.unique(ref.state["mexc.mix.divisors"].dequantize()).tolist())
    assert ratios == {1.0, 1.5, 2.25}
    np.testing.assert_array_equal(
        ref.state["mexc.mix.divisors"].dequantize(),
        _program("reference", bits).state["mexc.mix.divisors"].dequantize(),
    )


def test_groupnorm_of_a_one_by_one_map_is_torchs() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(1, 8), nn.Flatten(), nn.Linear(8, 3))
    x = np.random.default_rng(0).standard_normal((4, 3, 1, 1)).astype(np.float32)
    prog = mexc.compile(model, (torch.from_numpy(x),), rounding="nearest")
    (ln,) = prog.graph.nodes_of(Op.LAYERNORM)
    assert tuple(ln.type.shape) == (4, 8)  # normalized as (N, C)
    values = step_values(prog, x, np.zeros(4, np.int64))
    conv_out = torch.from_numpy(values[ln.inputs[0]].dequantize())
    want = F.group_norm(conv_out.reshape(4, 8, 1, 1), 1, eps=1e-5).reshape(4, 8).numpy()
    got = values[ln.out].dequantize()
    assert np.abs(got - want).max() <= 2 * 2.0 ** float(values[ln.out].e)
