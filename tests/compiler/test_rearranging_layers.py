"""Layers made of existing ops: channel dropout (nn.Dropout1d/2d/3d: dropout with one keep
decision per channel), adaptive max pooling (max pooling and/or nearest upsampling), the
pixel and channel shuffles (reshape, transpose, reshape), and zero padding (F.pad, ZeroPad2d:
`pad`, whose kernels are the slice gradient's, and slices where it crops), and the maximum over
axes (torch.max(x, dim), amax: a max pool over the reduced axes), Tensor.unfold (slices
concatenated), repeat, tile and repeat_interleave (broadcast copies). Each against torch where it
is exact, and models with all of them trained bit-exact on every backend:
reference, llvm, C, and the CUDA artifact's own source on the CPU emulator."""

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
from mexc.kernels.elementwise import dropout_group
from mexc.mx import MX, RoundCtx
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    small_batch,
    step_values,
    train_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


def test_channel_dropout_keeps_or_drops_whole_channels() -> None:
    x = MX.of(np.ones((8, 16, 3, 5), np.int8), -3)
    per = dropout_group(x.shape, "channel")
    assert per == 15
    y, mask = K.dropout_forward(x, 0.5, RoundCtx("stochastic", 4, 0, 8), 0, per)
    planes = np.asarray(y.m).reshape(8 * 16, 15)
    kept = planes.all(axis=1)
    assert (kept | ~planes.any(axis=1)).all()  # each channel all kept or all zero
    assert 40 <= kept.sum() <= 88  # about half of 128
    assert (np.asarray(mask).reshape(128, 15) == kept[:, None]).all()


def _graph_ops(layer: nn.Module, shape: tuple[int, ...]) -> list[Op]:
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(2, *shape))
    g = mexc.compile(model, (torch.zeros(2, *shape),), target="reference").graph
    return [n.op for n in g.nodes if n.op in (Op.MAXPOOL2D, Op.UPSAMPLE_NEAREST, Op.DROPOUT)]


@pytest.mark.parametrize(
    ("layer", "shape", "ops"),
    [
        (nn.AdaptiveMaxPool2d(1), (2, 5, 7), [Op.MAXPOOL2D]),
        (nn.AdaptiveMaxPool2d((2, 6)), (2, 16, 24), [Op.MAXPOOL2D]),
        (nn.AdaptiveMaxPool2d(8), (2, 4, 4), [Op.UPSAMPLE_NEAREST]),
        (nn.Dropout2d(0.3), (2, 4, 4), [Op.DROPOUT]),
        (nn.Dropout1d(0.3), (2, 4), [Op.DROPOUT]),
    ],
)
def test_layers_become_existing_ops(
    layer: nn.Module, shape: tuple[int, ...], ops: list[Op]
) -> None:
    assert _graph_ops(layer, shape) == ops


def test_the_c_backend_refuses_max_pool_windows_its_argmax_cannot_hold() -> None:
    """A global max pool of 17 x 17 (289 offsets: the C runtime keeps them in a uint8)."""
    model = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(2, 3))
    with pytest.raises(mexc.UnsupportedOpError, match="window of 289 elements; the C backend"):
        mexc.compile(model, (torch.zeros(2, 2, 17, 17),), target="c")
    mexc.compile(model, (torch.zeros(2, 2, 16, 16),), target="c")  # 256: fits


def test_adaptive_max_pool_is_torchs_and_refuses_indices() -> None:
    x = torch.randn(2, 3, 16, 24)
    pooled = F.max_pool2d(x, (8, 4))
    assert torch.equal(pooled, F.adaptive_max_pool2d(x, (2, 6)))
    model = nn.Sequential(nn.AdaptiveMaxPool2d(2, return_indices=True))
    with pytest.raises(mexc.UnsupportedOpError, match="returns indices"):
        mexc.compile(model, (torch.zeros(2, 2, 4, 4),))


class ShuffleNet(nn.Module):
    """Convolutions around a pixel shuffle and unshuffle (sub-pixel upsampling, space to depth),
    zero padding that pads and crops, a channel shuffle and channel dropout, then adaptive max
    pooling to 2 x 2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.drop = nn.Dropout2d(0.25)
        self.up = nn.PixelShuffle(2)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.crop = nn.ZeroPad2d((0, 0, 0, -1))
        self.shuffle = nn.ChannelShuffle(4)
        self.pool = nn.AdaptiveMaxPool2d(2)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.drop(F.relu(self.conv1(x))))  # 16 x 8 x 8 -> 4 x 16 x 16
        x = F.pad(self.conv2(x), (1, -1, 2, 0))  # 4 x 18 x 16 (TF's "same" padding)
        x = self.crop(F.pixel_unshuffle(x, 2))  # 16 x 9 x 8 -> 16 x 8 x 8
        x = F.channel_shuffle(self.shuffle(x), 2)
        return self.fc(torch.flatten(self.pool(x), 1))


@pytest.mark.parametrize(
    ("pads", "layer"),
    [((1, 2), None), ((0, 1, 3, 0), None), ((2, -1, -1, 1), None), (None, nn.ZeroPad2d(1))],
)
def test_zero_padding_is_torchs(pads: tuple[int, ...] | None, layer: nn.Module | None) -> None:
    """The padded mantissas (the input quantized, then padded) are torch's F.pad of them, and
    the gradient of a padded tensor is the slice of dy."""
    pad = layer if layer is not None else _Pad(pads)
    model = nn.Sequential(pad, nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(2, 2, 4, 5)
    model(x)
    prog = mexc.compile(model, (x,), target="reference")
    nodes = list(prog.graph.nodes)
    assert {Op.PAD, Op.SLICE} & {n.op for n in nodes}
    values = step_values(prog, x.numpy(), np.array([0, 1]))
    q = next(n for n in nodes if n.op is Op.QUANTIZE)
    padded = next(n for n in nodes if n.op is Op.RESHAPE)  # the flatten reads the padding
    m = torch.from_numpy(np.asarray(values[q.out].m).astype(np.int64))
    want = layer(m) if layer is not None else F.pad(m, pads)
    got = np.asarray(values[padded.inputs[0]].m)
    np.testing.assert_array_equal(got, want.numpy())


class _Pad(nn.Module):
    def __init__(self, pads: tuple[int, ...] | None) -> None:
        super().__init__()
        self.pads = pads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self.pads)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (nn.ConstantPad2d(1, 20.0), "pads with the value 20.0"),
        (_Pad((0, 0, 0, 0, 1, 1, 0, 0)), "the batch axis stays"),
    ],
)
def test_other_padding_is_refused(layer: nn.Module, message: str) -> None:
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(2, 2, 4, 4))
    with pytest.raises(mexc.UnsupportedOpError, match=message):
        mexc.compile(model, (torch.zeros(2, 2, 4, 4),))


class MaxOverAxes(nn.Module):
    """PointNet's global feature (x.max(dim=2)[0] over the points), amax over the spatial axes
    with keepdim, and torch.max over the channels (.values)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 1)
        self.conv2 = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(8 + 4 + 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        points = F.relu(self.conv(x.reshape(4, 3, 16)))  # 8 features x 16 points
        glob = points.max(dim=2)[0]  # (4, 8)
        img = self.conv2(x.reshape(4, 1, 6, 8))
        spatial = img.amax(dim=(2, 3), keepdim=True).flatten(1)  # (4, 4)
        chans = torch.max(img, 1).values.reshape(4, 48)[:, :16]  # over the channels
        return self.fc(torch.cat([glob, spatial, chans], dim=1))


def test_max_over_axes_is_torchs() -> None:
    """Three max pools, each window's value the maximum of its inputs exactly (the step's
    values at learning rate 0)."""
    torch.manual_seed(0)
    model = MaxOverAxes()
    prog = mexc.compile(model, (torch.zeros(4, 1, 6, 8),), target="reference")
    ops = [n.op for n in prog.graph.nodes]
    assert ops.count(Op.MAXPOOL2D) == 3
    x = np.random.default_rng(4).permutation(192).reshape(4, 1, 6, 8).astype(np.float32) / 64
    values = step_values(prog, x, np.array([0, 1, 2, 3]))
    pools = [n for n in prog.graph.nodes if n.op is Op.MAXPOOL2D]
    src = [values[n.inputs[0]] for n in pools]
    got = [values[n.out] for n in pools]
    for s, g in zip(src, got):  # each window's maximum, exactly
        np.testing.assert_array_equal(np.asarray(g.m)[..., 0, 0], np.asarray(s.m).max(axis=(2, 3)))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        ShuffleNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


def test_shuffles_move_mantissas_as_torch_does() -> None:
    prog = _program("reference")
    values = step_values(prog, *small_batch())
    nodes = list(prog.graph.nodes)
    drop = next(n for n in nodes if n.op is Op.DROPOUT)
    shuffled = next(
        n for n in nodes if n.op is Op.RESHAPE and tuple(n.type.shape) == (4, 4, 16, 16)
    )
    dropped = np.asarray(values[drop.out].m).astype(np.int64)
    want = F.pixel_shuffle(torch.from_numpy(dropped), 2).numpy()
    np.testing.assert_array_equal(np.asarray(values[shuffled.out].m), want)
    assert (want == 0).any() and (want != 0).any()


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    want = train_checksums(ref)
    assert len(set(want)) == 3
    assert train_checksums(_program("llvm", bits)) == want
    assert train_checksums(_program("c", bits)) == want


def test_max_over_axes_trains_bit_exact_on_reference_llvm_and_c() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 1, 6, 8)).astype(np.float32), rng.integers(0, 10, 4)

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(MaxOverAxes(), (torch.zeros(4, 1, 6, 8),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, (x, y))


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)


class Windows(nn.Module):
    """HaloNet's overlapping key blocks (unfold with step < size over both spatial axes) and
    windows that tile an axis (step == size)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 1)
        self.fc = nn.Linear(4 * 3 * 3 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)  # (4, 4, 8, 8)
        blocks = y.unfold(2, 4, 2).unfold(3, 4, 2)  # (4, 4, 3, 3, 4, 4)
        tiles = y.unfold(1, 2, 2)  # (4, 2, 8, 8, 2)
        return self.fc(blocks.flatten(1)) + tiles.mean((1, 2, 3, 4)).unsqueeze(1)


def test_unfold_windows_are_torchs_and_train_bit_exact() -> None:
    """Each window's mantissas are torch's unfold of the convolution's (the step's values at
    learning rate 0), and the model trains bit-exact on reference, llvm and C."""
    x = np.random.default_rng(5).standard_normal((4, 1, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 3])

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(Windows(), (torch.zeros(4, 1, 8, 8),), target=target)

    ref = program("reference")
    values = step_values(ref, x, y)
    conv = next(n for n in ref.graph.nodes if n.op is Op.CONV2D_COMPACT)
    flat = next(n for n in ref.graph.nodes if tuple(n.type.shape) == (4, 576))
    src = torch.from_numpy(np.asarray(values[conv.out].m).astype(np.int64))
    want = src.unfold(2, 4, 2).unfold(3, 4, 2).flatten(1).numpy()
    np.testing.assert_array_equal(np.asarray(values[flat.out].m), want)
    assert_trains_bit_exact_on_llvm_and_c(ref, program, (x, y))


def test_unfolding_the_batch_axis_is_refused() -> None:
    class BatchWindows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.unfold(0, 2, 1).flatten(1)[:, :10]

    with pytest.raises(mexc.UnsupportedOpError, match="unfolds the batch axis"):
        mexc.compile(BatchWindows(), (torch.zeros(4, 16),))


class Repeats(nn.Module):
    """Grouped-query attention's keys (repeat_interleave over the heads), x.repeat and
    torch.tile along non-batch axes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.fc = nn.Linear(4 * 8 * 16 + 16 * 32 + 8 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (4, 8, 16)
        kv = self.proj(x).view(4, 8, 2, 16)
        heads = kv.repeat_interleave(2, dim=2)  # (4, 8, 4, 16)
        tiled = torch.tile(x, (2,))  # (4, 8, 32)
        parts = [heads.flatten(1), x.repeat(1, 2, 2).flatten(1), tiled.flatten(1)]
        return self.fc(torch.cat(parts, 1))


def test_repeats_copy_torchs_mantissas_and_train_bit_exact() -> None:
    x = np.random.default_rng(6).standard_normal((4, 8, 16)).astype(np.float32)
    y = np.array([0, 1, 2, 3])

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(Repeats(), (torch.zeros(4, 8, 16),), target=target)

    ref = program("reference")
    values = step_values(ref, x, y)
    lin = next(n for n in ref.graph.nodes if n.op is Op.LINEAR_COMPACT)
    heads = next(n for n in ref.graph.nodes if tuple(n.type.shape) == (4, 8, 4, 16))
    src = torch.from_numpy(np.asarray(values[lin.out].m).astype(np.int64))
    want = src.view(4, 8, 2, 16).repeat_interleave(2, dim=2).numpy()
    np.testing.assert_array_equal(np.asarray(values[heads.out].m), want)
    assert_trains_bit_exact_on_llvm_and_c(ref, program, (x, y))


def test_tiling_the_batch_axis_is_refused() -> None:
    class BatchRepeat(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.repeat(2, 1)[:4, :10]

    with pytest.raises(mexc.UnsupportedOpError, match="batch axis"):
        mexc.compile(BatchRepeat(), (torch.zeros(4, 16),))


class GlobalQueries(nn.Module):
    """GCViT: each sample's global query repeated (repeat_interleave over the batch axis) for
    its 4 windows merged into the batch, then a product with the window tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.fc = nn.Linear(16 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16, 8): 4 windows of 4 tokens
        b = x.shape[0]
        g = self.q(x.mean(1, keepdim=True)).repeat_interleave(4, dim=0)  # (4B, 1, 8)
        return self.fc((x.reshape(b * 4, 4, 8) * g).reshape(b, -1))


def test_repeating_each_sample_for_its_windows_matches_torch_and_trains_bit_exact() -> None:
    x = np.random.default_rng(7).standard_normal((4, 16, 8)).astype(np.float32)
    torch.manual_seed(0)
    model = GlobalQueries()
    prog = mexc.compile(model, (torch.from_numpy(x),), rounding="nearest")
    assert_logits_match_torch(model, prog, x)

    def program(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return mexc.compile(GlobalQueries(), (torch.from_numpy(x),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, (x, np.arange(4)))
