"""Parameters and buffers read through indexing (gather_param): Swin's relative-position bias
table indexed by a buffer of offsets and its shifted-window mask, LeViT's per-head biases, in
explicit and fused (SDPA attn_mask) attention; with torch.roll and strided slices, the other
ops of those models. Against torch, and bit-exact on reference, llvm, C and the CUDA source."""

from __future__ import annotations

import json
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
from mexc.ops.gather import _period
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    dequantized_copy,
    float_gradients,
    integer_gradients,
    small_batch,
    train_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

WS = 2  # window size: 4 windows of 4 tokens over a 4 x 4 map


def relative_index(ws: int) -> torch.Tensor:
    """Swin's relative_position_index: (ws², ws²) offsets into a (2 ws - 1)² table."""
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = coords.flatten(1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0) + (ws - 1)
    return rel[:, :, 0] * (2 * ws - 1) + rel[:, :, 1]


def window_mask(size: int, ws: int, shift: int) -> torch.Tensor:
    """Swin's attention mask of shifted windows: (windows, ws², ws²) of 0 and -100."""
    regions = torch.zeros(size, size)
    cuts = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
    for k, (a, b) in enumerate((a, b) for a in cuts for b in cuts):
        regions[a, b] = k
    win = regions.view(size // ws, ws, size // ws, ws).permute(0, 2, 1, 3).reshape(-1, ws * ws)
    diff = win[:, None, :] - win[:, :, None]
    return diff.ne(0).float() * -100.0


class ShiftedWindows(nn.Module):
    """A Swin block over a 4 x 4 map of `dim` channels: rolled by one, 2 x 2 windows, two
    heads with a trained relative-position bias and the shifted-window mask (a buffer), rolled
    back; `fused`: through F.scaled_dot_product_attention's attn_mask, as timm's fused path."""

    def __init__(self, dim: int = 8, heads: int = 2, fused: bool = False) -> None:
        super().__init__()
        self.heads, self.fused = heads, fused
        self.embed = nn.Conv2d(1, dim, 2, stride=2)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.randn((2 * WS - 1) ** 2, heads) * 0.5)
        self.register_buffer("index", relative_index(WS))
        self.register_buffer("mask", window_mask(4, WS, 1))
        self.softmax = nn.Softmax(dim=-1)
        self.head = nn.Linear(dim, 10)

    def attend(self, w: torch.Tensor) -> torch.Tensor:
        bw, n, c = w.shape
        qkv = self.qkv(w).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()
        nw = self.mask.shape[0]
        if self.fused:
            mask = self.mask.view(1, nw, 1, n, n).expand(bw // nw, -1, self.heads, -1, -1)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.unsqueeze(0) + mask.reshape(-1, self.heads, n, n)
            )
        else:
            attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1) + bias.unsqueeze(0)
            attn = attn.view(-1, nw, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
            out = self.softmax(attn.view(-1, self.heads, n, n)) @ v
        return self.proj(out.transpose(1, 2).reshape(bw, n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x).permute(0, 2, 3, 1)  # (B, 4, 4, C)
        b, h, w, c = y.shape
        s = torch.roll(y, shifts=(-1, -1), dims=(1, 2))
        win = s.view(b, h // WS, WS, w // WS, WS, c).permute(0, 1, 3, 2, 4, 5)
        out = self.attend(win.reshape(-1, WS * WS, c))
        out = out.view(b, h // WS, w // WS, WS, WS, c).permute(0, 1, 3, 2, 4, 5)
        out = torch.roll(out.reshape(b, h, w, c), shifts=(1, 1), dims=(1, 2)) + y
        return self.head(out.mean((1, 2)))


class HeadBiases(nn.Module):
    """LeViT's attention: per-head biases indexed by a (N, N) buffer, `biases[:, idxs]`, and
    its subsampling of every other row and column (x[:, ::2, ::2], 5 -> 3)."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv2d(1, dim, 2, stride=2, padding=1)  # (B, C, 5, 5)
        self.qkv = nn.Linear(dim, 3 * dim)
        pts = [(i, j) for i in range(3) for j in range(3)]
        offsets: dict[tuple[int, int], int] = {}
        idxs = [
            offsets.setdefault((abs(a[0] - b[0]), abs(a[1] - b[1])), len(offsets))
            for a in pts
            for b in pts
        ]
        self.biases = nn.Parameter(torch.randn(heads, len(offsets)) * 0.5)
        self.register_buffer("idxs", torch.tensor(idxs).view(9, 9))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x).permute(0, 2, 3, 1)[:, ::2, ::2]  # (B, 3, 3, C)
        b, h, w, c = y.shape
        t = y.reshape(b, h * w, c)
        q, k, v = self.qkv(t).view(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * 0.5 + self.biases[:, self.idxs]
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, h * w, c)
        return self.head(out.mean(1))


MODELS = {
    "windows": lambda: ShiftedWindows(),
    "fused_windows": lambda: ShiftedWindows(fused=True),
    "head_biases": lambda: HeadBiases(),
}


def _program(name: str, target: str = "reference", bits: int = 8, **kw: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(MODELS[name](), (torch.zeros(4, 1, 8, 8),), target=target, bits=bits, **kw)


@pytest.mark.parametrize(("name", "period"), [("windows", 1), ("fused_windows", 4)])
def test_the_bias_and_mask_are_gathered_once_each(name: str, period: int) -> None:
    prog = _program(name)
    gathers = prog.graph.nodes_of(Op.GATHER_PARAM)
    sources = sorted(str(prog.graph.node(n.inputs[0].node).attrs.name) for n in gathers)
    # the mask buffer is a constant of the program, never trained
    assert len(sources) == 2 and sources[0].startswith("mexc.") and sources[1] == "table"
    mask = next(n for n in gathers if "mexc." in str(prog.graph.node(n.inputs[0].node).attrs.name))
    # it varies over the 4 windows of a sample: added to the scores seen as (batch, windows,
    # heads, 4, 4), or (fused) to (batch x windows, heads, 4, 4) with one index row per window
    assert int(mask.attrs.period) == period and len(mask.attrs.index) == 4 * 2 * 4 * 4
    held = prog.state[sources[0]].dequantize().reshape(4, 4, 4)
    assert np.array_equal(held, window_mask(4, WS, 1).numpy())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_torch(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


# the table's gradient is the sum of many int8 score gradients, whose stochastic rounding
# noise adds up where their signal cancels (the same model's qkv.weight measured 0.992, the
# table 0.976; 0.993 under nearest rounding): the gather's own sums are exact
@pytest.mark.parametrize(
    ("name", "table", "least"), [("windows", "table", 0.97), ("head_biases", "biases", 0.99)]
)
def test_the_table_gradient_follows_autograd(name: str, table: str, least: float) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    x, y = small_batch((32, 1, 8, 8))
    got = integer_gradients(prog, x, y)[table]
    want = float_gradients(model, prog, x, y)[table]
    assert cosine(got, want) >= least, cosine(got, want)


@pytest.mark.parametrize(
    ("name", "bits"), [("windows", 8), ("fused_windows", 4), ("head_biases", 8)]
)
def test_model_trains_bit_exact_on_reference_llvm_and_c(name: str, bits: int) -> None:
    assert_trains_bit_exact_on_llvm_and_c(
        _program(name, bits=bits), lambda t: _program(name, t, bits)
    )


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    """The emulated sm_80 artifact trains bit-exact, and its SASS (gather and scatter-sum
    kernels included) keeps cuda_verify's rules: integer only."""
    from mexc.backends.cuda.sass_check import verify_artifact

    assert_cuda_source_trains_bit_exact(_program("windows"), tmp_path)
    assert verify_artifact(tmp_path, json.loads((tmp_path / "plan.json").read_text())) == []


def test_the_period_is_the_shortest_repeat_of_the_rows() -> None:
    rows = np.array([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert _period(rows) == 2
    assert _period(np.zeros((6, 3), np.int64)) == 1
    assert _period(np.arange(8).reshape(4, 2)) == 4


class RollAndStride(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 3 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.roll(self.conv(x), shifts=(2, -3), dims=(2, 3)).roll(1, 3)
        return self.head(y[:, :, 1::3, ::4].flatten(1))  # 7 rows -> 2... of an 8 x 8 map


def test_roll_and_strided_slices_match_torch() -> None:
    torch.manual_seed(0)
    model = RollAndStride()
    prog = mexc.compile(model, (torch.zeros(4, 1, 8, 8),), rounding="nearest")
    x = np.random.default_rng(1).standard_normal((4, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)
    assert_trains_bit_exact_on_llvm_and_c(
        mexc.compile(model, (torch.zeros(4, 1, 8, 8),)),
        lambda t: mexc.compile(model, (torch.zeros(4, 1, 8, 8),), target=t),
    )


class BiasThroughSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))
        self.register_buffer("index", torch.arange(4))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1)) * torch.sigmoid(self.table[self.index]).sum()


def test_a_gathered_parameter_used_as_an_activation_is_refused_by_node() -> None:
    with pytest.raises(UnsupportedOpError, match="read through indexing"):
        mexc.compile(BiasThroughSigmoid(), (torch.zeros(2, 1, 8, 8),))


class MadeInForward(nn.Module):
    """Constants the forward builds from shapes: a position ramp from torch.arange and a mask
    written into x.new_zeros (as torchvision's Swin builds its window mask), then
    masked_fill; folded on the host into frontend constants."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        h = y.shape[2]
        ramp = torch.arange(h, dtype=torch.float32) / h
        mask = y.new_zeros((h, h))
        mask[: h // 2, :] = 1
        mask = mask.masked_fill(mask != 0, -0.5)
        return self.head((y + ramp.view(1, 1, h, 1) + mask).flatten(1))


def test_constants_made_in_forward_are_folded() -> None:
    torch.manual_seed(0)
    model = MadeInForward()
    prog = mexc.compile(model, (torch.zeros(4, 1, 8, 8),), rounding="nearest")
    made = sorted(
        str(n.attrs.name) for n in prog.graph.nodes_of(Op.PARAM) if "mexc." in str(n.attrs.name)
    )
    trained = {str(n.attrs.param) for n in prog.graph.nodes_of(Op.SGD_UPDATE)}
    assert len(made) == 2 and not set(made) & trained
    x = np.random.default_rng(2).standard_normal((4, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


class IndexesTheBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.flatten(1).unsqueeze(0)  # (1, B, 64): axis 0 is not the batch
        return self.head(t[0] + x.flatten(1)[1:2].expand(x.shape[0], -1))


def test_indexing_follows_the_batch_axis() -> None:
    """t[0] on an axis put before the batch is a slice; x[1:2] of the batch is refused."""
    with pytest.raises(UnsupportedOpError, match="indexes the batch axis"):
        mexc.compile(IndexesTheBatch(), (torch.zeros(4, 1, 8, 8),))


def test_torchvision_swin_traces_through_its_wrapped_functions() -> None:
    """torchvision's Swin: shifted_window_attention, _get_relative_position_bias and
    _patch_merging_pad (torch.fx leaves) traced through, its window mask (x.new_zeros written
    in place) folded; logits follow torch and llvm trains bit-exact with the reference."""
    swin = pytest.importorskip("torchvision.models.swin_transformer")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return swin.SwinTransformer(
            patch_size=[2, 2], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
            window_size=[2, 2], num_classes=10,
        )  # fmt: skip

    example = (torch.zeros(4, 3, 8, 8),)
    prog = mexc.compile(build(), example, rounding="nearest")
    # 4 bias tables, 1 mask: stage 2 (2 x 2 tokens) is one window, where Swin does not shift
    assert len(prog.graph.nodes_of(Op.GATHER_PARAM)) == 5
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    ref = dequantized_copy(build(), prog).eval()
    xq = mexc.kernels.quantize(x.astype(np.float64), 8).dequantize()
    assert cosine(prog.logits(x), ref(torch.from_numpy(xq)).detach().numpy()) >= 0.99
    batch = (x, np.arange(4) % 10)
    want = train_checksums(mexc.compile(build(), example), batch)
    assert train_checksums(mexc.compile(build(), example, target="llvm"), batch) == want
