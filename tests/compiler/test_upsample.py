"""Nearest upsampling and adaptive average pooling to any size whose windows have one size
(docs/layers.md): the integer forms against torch's float ops, the decompositions the frontend
picks, clear errors for what is not lowered, and a model (an FPN-like top-down path and a
VGG-like head) trained bit-exact on every backend: reference, llvm, C, and the CUDA artifact's
own source on the CPU emulator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.ir import Op
from mexc.mx import MX, RoundCtx
from mexc.ops import REGISTRY
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    step_values,
    train_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

NEAREST = RoundCtx("nearest", 0, 0, 8)


def _float(v: MX) -> np.ndarray:
    return v.m.astype(np.float64) * 2.0 ** float(v.e)


def _mx(shape: tuple[int, ...], e: int, seed: int) -> MX:
    rng = np.random.default_rng(seed)
    return MX.of(rng.integers(-127, 128, shape).astype(np.int8), e)


@pytest.mark.parametrize("scale", [(2, 2), (3, 1), (1, 4), (7, 7)])
def test_upsampling_is_torch_exactly_and_its_gradient_rounded_once(scale: tuple[int, int]) -> None:
    x = _mx((2, 3, 4, 5), -5, sum(scale))
    y = K.upsample_nearest_forward(x, scale)
    xt = torch.from_numpy(_float(x)).requires_grad_()
    yt = F.interpolate(xt, scale_factor=scale, mode="nearest")
    np.testing.assert_array_equal(_float(y), yt.detach().numpy())
    dy = _mx(tuple(y.m.shape), -6, 3)
    yt.backward(torch.from_numpy(_float(dy)))
    dx = K.upsample_nearest_backward(dy, scale, NEAREST, 0)
    assert xt.grad is not None
    assert np.abs(_float(dx) - xt.grad.numpy()).max() <= 0.5 * 2.0 ** float(dx.e)
    if scale == (3, 1):  # sums of 3 int8 values need more than 8 bits: rounded
        assert dx.e > dy.e


def test_a_gradient_that_fits_is_exact() -> None:
    dy = MX.of(np.ones((1, 1, 4, 4), np.int8), -3)
    dx = K.upsample_nearest_backward(dy, (2, 2), NEAREST, 0)
    assert dx.e == -3 and (dx.m == 4).all()


class _Resize(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.layer(x), 1)


def _resized_and_torchs(
    layer: nn.Module, size: tuple[int, int], seed: int
) -> tuple[MX, np.ndarray]:
    """The layer's integer result (flattened, from a step's values with nearest rounding) on
    a random (2, 2, *size) input, and torch's layer on the same int8 input."""
    model = nn.Sequential(_Resize(layer), nn.LazyLinear(3))
    model(torch.zeros(2, 2, *size))
    prog = mexc.compile(model, (torch.zeros(2, 2, *size),), rounding="nearest")
    x = np.random.default_rng(seed).standard_normal((2, 2, *size)).astype(np.float32)
    values = step_values(prog, x, np.array([0, 1]))
    names = {n.out: n.attrs.name for n in prog.graph.nodes if n.op is Op.PARAM}
    head = next(  # the linear layer after the flatten, whose input is the result
        n for n in prog.graph.nodes if len(n.inputs) > 1 and names.get(n.inputs[1]) == "1.weight"
    )
    xq = K.quantize(x.astype(np.float64), 8).dequantize()
    return values[head.inputs[0]], layer(torch.from_numpy(xq)).flatten(1).numpy()


def _ops(layer: nn.Module, size: tuple[int, int]) -> list[Op]:
    model = nn.Sequential(_Resize(layer), nn.LazyLinear(3))
    model(torch.zeros(2, 2, *size))  # materialize the lazy layer
    g = mexc.compile(model, (torch.zeros(2, 2, *size),), target="reference").graph
    pools = {Op.AVGPOOL2D, Op.UPSAMPLE_NEAREST, Op.GLOBAL_AVGPOOL}
    return [n.op for n in g.nodes if n.op in pools]


@pytest.mark.parametrize(
    ("size", "out", "ops"),
    [
        ((1, 1), (7, 7), [Op.UPSAMPLE_NEAREST]),  # VGG's head at 32 x 32
        ((7, 7), (7, 7), []),  # ... and at 224 x 224
        ((16, 24), (2, 6), [Op.AVGPOOL2D]),
        ((4, 1), (2, 7), [Op.AVGPOOL2D, Op.UPSAMPLE_NEAREST]),
        ((5, 5), (1, 1), [Op.GLOBAL_AVGPOOL]),
        ((5, 5), (3, 3), [Op.AVGPOOL2D] * 6),  # windows of 2 and 3: one pool per window
        ((7, 2), (3, 4), [Op.AVGPOOL2D] * 3 + [Op.UPSAMPLE_NEAREST]),
    ],
)
def test_adaptive_average_pooling_decomposes(
    size: tuple[int, int], out: tuple[int, int], ops: list[Op]
) -> None:
    assert _ops(nn.AdaptiveAvgPool2d(out), size) == ops


@pytest.mark.parametrize(("size", "out"), [((16, 24), (2, 6)), ((4, 1), (2, 7))])
def test_the_decomposition_is_torchs_adaptive_pool(
    size: tuple[int, int], out: tuple[int, int]
) -> None:
    x = _mx((2, 3, *size), -4, 5)
    k = (size[0] // out[0] or 1, size[1] // out[1] or 1)
    mid = K.avgpool2d_forward(x, k, k, (0, 0), NEAREST, 0)
    up = (max(out[0] // size[0], 1), max(out[1] // size[1], 1))
    y = K.upsample_nearest_forward(mid, up)
    want = F.adaptive_avg_pool2d(torch.from_numpy(_float(x)), out).numpy()
    assert np.abs(_float(y) - want).max() <= 0.5 * 2.0 ** float(y.e)


@pytest.mark.parametrize(
    ("layer", "size"),
    [
        (nn.AdaptiveAvgPool2d(3), (5, 5)),
        (nn.AdaptiveAvgPool2d((3, 4)), (7, 6)),
        (nn.AdaptiveMaxPool2d((3, 5)), (5, 3)),
    ],
)
def test_adaptive_pooling_with_windows_of_several_sizes_is_torchs(
    layer: nn.Module, size: tuple[int, int]
) -> None:
    """Each window (torch's [floor(i L / o), ceil((i + 1) L / o))) pooled on its own: the
    maximum exactly, the mean to half a unit of the last place per pooling step."""
    got, want = _resized_and_torchs(layer, size, seed=4)
    assert np.abs(got.dequantize() - want).max() <= 2.0 ** float(got.e)


@pytest.mark.parametrize(
    ("layer", "size"),
    [
        (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), (4, 4)),  # U-Nets'
        (nn.UpsamplingBilinear2d(scale_factor=2), (4, 5)),
        (nn.Upsample(scale_factor=2, mode="bicubic"), (4, 4)),
        # torch reads the source at j / 3.4 (not j / 3) and at 2.5 i + 0.75 (not 3 i + 1)
        (nn.Upsample(scale_factor=(1, 3.4), mode="bilinear"), (4, 2)),
        (nn.Upsample(scale_factor=(0.4, 1), mode="bilinear"), (6, 4)),
        (nn.Upsample(scale_factor=(1, 3.4)), (4, 2)),
        (nn.Upsample(scale_factor=1.5), (4, 4)),
        (nn.Upsample(size=(3, 5), mode="area"), (8, 8)),
        (nn.Upsample(scale_factor=2, mode="trilinear"), (2, 3, 4)),
        (nn.Upsample(scale_factor=(1, 2, 2)), (2, 2, 3)),
        # one such resampling reading another (its input has no traced shape until rewritten)
        (
            nn.Sequential(nn.Upsample(scale_factor=1.5), nn.Upsample(size=(5, 5), mode="bicubic")),
            (4, 4),
        ),
    ],
)
def test_resampling_without_an_op_of_its_own_is_products_with_torchs_matrices(
    layer: nn.Module, size: tuple[int, ...]
) -> None:
    """frontend_resample: one product per changed axis with the matrix torch applies there
    (each was refused by node). Within two units of the result's last place of torch's on the
    same int8 input (measured: at most 1.9), though the matrices are int8 constants (a weight
    of 1/3 to 7 bits) and each product rounds."""
    assert Op.UPSAMPLE_NEAREST not in _ops(layer, size)
    got, want = _resized_and_torchs(layer, size, seed=5)
    assert np.abs(_float(got) - want).max() <= 2.0 * 2.0 ** float(got.e)


@pytest.mark.parametrize(
    ("layer", "size"),
    [
        (nn.Upsample(size=(2, 3)), (8, 6)),  # every 4th row, every 2nd column, from the first
        (nn.Upsample(scale_factor=(0.25, 2), mode="nearest-exact"), (8, 3)),  # the middle ones
        (nn.Upsample(size=(1, 4), mode="nearest"), (5, 8)),
    ],
)
def test_nearest_downsampling_picks_torchs_pixels_exactly(
    layer: nn.Module, size: tuple[int, int]
) -> None:
    got, want = _resized_and_torchs(layer, size, 7)
    np.testing.assert_array_equal(_float(got), want)


@pytest.mark.parametrize(
    ("layer", "size"),
    [
        (nn.Upsample(scale_factor=2, mode="bilinear"), (4, 6)),
        (nn.Upsample(scale_factor=(3, 4), mode="bilinear", align_corners=False), (3, 5)),
        (nn.Upsample(scale_factor=(0.5, 1 / 3), mode="bilinear"), (4, 6)),  # down (CoaT)
        (nn.Upsample(scale_factor=(2, 0.25), mode="bilinear"), (3, 8)),
    ],
)
def test_bilinear_upsampling_is_torchs_to_its_rounding(
    layer: nn.Module, size: tuple[int, int]
) -> None:
    """Each phase is two scales and an add per axis, the phases one concatenation
    (docs/frontend.md): against torch's bilinear of the same int8 input, within two units of
    the result's last place (measured: 2.0 in both cases, those roundings compounded)."""
    got, want = _resized_and_torchs(layer, size, seed=3)
    assert np.abs(got.dequantize() - want).max() <= 2 * 2.0 ** float(got.e)


def test_registry_defines_upsampling_on_every_backend() -> None:
    for op in (Op.UPSAMPLE_NEAREST, Op.UPSAMPLE_NEAREST_GRAD):
        assert all(REGISTRY[op].supports(b) for b in ("reference", "llvm", "cuda", "c")), op


class TopDownNet(nn.Module):
    """An FPN-like top-down path (a coarse map upsampled by nn.Upsample and F.interpolate with
    a size, nearest, bilinear and bilinear with align_corners=True, added to a finer one) and
    VGG's head at a small input
    (adaptive pooling of a 2 x 2 map to 4 x 4, then to 2 x 2 again)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.up = nn.Upsample(scale_factor=2)
        self.mid = nn.Conv2d(8, 8, 3, stride=4, padding=1)
        self.grow = nn.AdaptiveAvgPool2d((4, 4))
        self.shrink = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fine = F.relu(self.stem(x))  # 8 x 8
        coarse = F.relu(self.bn(self.down(fine)))  # 4 x 4
        mid = self.mid(fine)  # 2 x 2
        merged = fine + self.up(coarse) + F.interpolate(mid, size=(8, 8))
        merged = merged + F.interpolate(mid, scale_factor=4, mode="bilinear")
        # align_corners=True: products with torch's matrices (frontend_resample); by keyword
        corners = F.interpolate(input=coarse, size=(8, 8), mode="bilinear", align_corners=True)
        merged = merged + corners
        return self.fc(torch.flatten(self.shrink(self.grow(F.max_pool2d(merged, 4))), 1))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        TopDownNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    ops = [n.op for n in ref.graph.nodes]
    assert ops.count(Op.UPSAMPLE_NEAREST) == 3 and ops.count(Op.UPSAMPLE_NEAREST_GRAD) == 3
    want = train_checksums(ref)
    assert len(set(want)) == 3
    assert train_checksums(_program("llvm", bits)) == want
    assert train_checksums(_program("c", bits)) == want


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)
