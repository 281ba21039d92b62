"""The ops that torchvision and timm models need beyond the example models (issue: models users
bring): concatenation, ceil_mode max pooling, Hardsigmoid, products of two tensors (gating and
layer scale), sigmoid and SiLU, stochastic depth, a class token (a parameter expanded over the
batch) and the attention modules of timm and torchvision. Each op's TIR kernels against mexc.kernels
where its recipe branches, its integer form against torch's float op, and a small model that
uses it trained bit-exact on every backend: reference, llvm, C, and the CUDA artifact's own
source on the CPU emulator."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from mexc.mx import MX, RoundCtx
from mexc.ops import REGISTRY
from tests.compiler.helpers import one_i32 as _i32
from tests.compiler.helpers import run_fused as _fused
from tests.compiler.helpers import run_kernel as _run
from tests.compiler.helpers import site_key_buffer as _key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

ROUNDINGS = ("stochastic", "nearest")
BACKENDS = ("reference", "llvm", "cuda", "c")


def _float(v: MX) -> np.ndarray:
    return v.m.astype(np.float64) * 2.0 ** float(v.e)


# ----------------------------------------------------------------------------- concatenation


def test_registry_defines_concat_on_every_backend() -> None:
    assert all(REGISTRY[Op.CONCAT].supports(b) for b in BACKENDS)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("exps", [(-5, -5, -5), (-3, -6, -4), (-40, -2, -9), (2, -30, -1)])
@pytest.mark.parametrize("dim", [1, 2])
def test_concat_kernels_equal_the_reference(exps: tuple[int, ...], dim: int, rounding: str) -> None:
    """Inputs of 3, 5 and 2 along `dim` of (4, ., 6) or (4, 7, .): exponents equal, a few
    apart (exact alignment), and more than 24 apart (the smaller ones rounded, site 0)."""
    from mexc.lowering import te_ops

    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    rng = np.random.default_rng(abs(sum(exps)) + dim)
    sizes = (3, 5, 2)
    shapes = [(4, k, 6) if dim == 1 else (4, 7, k) for k in sizes]
    xs = [rng.integers(-127, 128, s, dtype=np.int8) for s in shapes]
    want = K.concat_forward([MX.of(x, e) for x, e in zip(xs, exps)], dim, ctx, 9)
    outer, inner = (4, 6) if dim == 1 else (28, 1)
    kernels = te_ops.concat_compaction(outer, sizes, inner, 8, rounding == "stochastic", "k")
    views = [x.reshape(outer, k, *((inner,) if inner > 1 else ())) for x, k in zip(xs, sizes)]
    out_shape = (outer, sum(sizes), *((inner,) if inner > 1 else ()))
    inputs = [*views, *(_i32(e) for e in exps), _key(ctx, 9, 0)]
    m, e = _fused(kernels, inputs, _key(ctx, 9, 1), out_shape)
    np.testing.assert_array_equal(m.reshape(want.m.shape), want.m)
    assert e == int(want.e)


def test_concat_is_torch_cat_rounded_once() -> None:
    """Exponents 8 apart: the result is torch.cat within half a unit of its exponent."""
    ctx = RoundCtx("nearest", 0, 0, 8)
    rng = np.random.default_rng(1)
    a = MX.of(rng.integers(-127, 128, (2, 3, 4), dtype=np.int8), -10)
    b = MX.of(rng.integers(-127, 128, (2, 5, 4), dtype=np.int8), -2)
    y = K.concat_forward([a, b], 1, ctx, 0)
    want = torch.cat([torch.from_numpy(_float(a)), torch.from_numpy(_float(b))], 1).numpy()
    assert np.abs(_float(y) - want).max() <= 0.5 * 2.0 ** float(y.e)
    np.testing.assert_array_equal(_float(y)[:, 3:], want[:, 3:])  # b's exponent: exact


class CatNet(nn.Module):
    """Two convolutions concatenated on channels (one after ReLU), batch norm over the result,
    and two flattened features concatenated (the same tensor twice, one scaled) before the
    head: the gradient of a value read twice through one concat."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(10)
        self.fc = nn.Linear(10 * 4 * 4 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.a(x), torch.relu(self.b(x))], 1)
        y = nn.functional.max_pool2d(torch.relu(self.bn(y)), 2)
        y = torch.flatten(y, 1)
        return self.fc(torch.cat((y, y * 0.5), dim=1))


# ----------------------------------------------------------------------------- ceil_mode pooling


@pytest.mark.parametrize(
    "kernel,stride,padding,size", [(3, 2, 0, 8), (2, 2, 0, 7), (3, 2, 1, 6), (3, 3, 0, 5)]
)
def test_ceil_mode_max_pool_is_torch(kernel: int, stride: int, padding: int, size: int) -> None:
    """The reference and the TIR kernels (forward, and the backward's gather) against torch's
    ceil_mode windows: the same maxima and the same first-maximum positions."""
    from mexc.lowering import te_ops

    rng = np.random.default_rng(size)
    x = rng.integers(-127, 128, (2, 3, size, size), dtype=np.int8)
    pool = nn.MaxPool2d(kernel, stride, padding, ceil_mode=True, return_indices=True)
    want, where = pool(torch.from_numpy(x.astype(np.float32)))
    oh = want.shape[2]
    extra = (oh - 1) * stride + kernel - (size + 2 * padding)
    assert extra > 0  # the case ceil_mode adds windows for
    y, arg = K.maxpool2d_forward(MX.of(x, -3), kernel, stride, padding, (extra, extra))
    np.testing.assert_array_equal(y.m, want.numpy().astype(np.int8))
    ty, targ = _run(
        te_ops.maxpool_forward(
            x.shape, kernel, stride, padding, "k", "int32", extra=(extra, extra)
        ),
        x,
        outs=[(want.shape, "int8"), (want.shape, "int32")],
    )
    np.testing.assert_array_equal(ty, y.m)
    np.testing.assert_array_equal(targ, arg)
    dy = rng.integers(-60, 60, want.shape, dtype=np.int8)
    ctx = RoundCtx("nearest", 0, 0, 8)
    dx = K.maxpool2d_backward(
        MX.of(dy, -4), arg, x.shape, kernel, stride, padding, ctx, 0, (extra, extra)
    )
    flat = np.zeros(x.size, np.int64)  # torch's indices: dy summed where each window's max is
    np.add.at(
        flat,
        (where.numpy() + np.arange(6)[:, None, None].reshape(2, 3, 1, 1) * size**2).ravel(),
        dy.astype(np.int64).ravel(),
    )
    np.testing.assert_array_equal(dx.m.astype(np.int64).ravel(), flat)
    (tacc,) = _run(
        te_ops.maxpool_backward_acc(
            x.shape, kernel, stride, padding, "g", "int32", extra=(extra, extra)
        ),
        dy,
        arg.astype(np.int32),
        outs=[(x.shape, "int32")],
    )
    np.testing.assert_array_equal(tacc.ravel(), flat)


class CeilPoolNet(nn.Module):
    """Max pools whose ceil_mode windows reach past the input (3, stride 2: 8 -> 4 after a ReLU,
    4 -> 2 on a convolution's signed output)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(torch.relu(self.conv1(x)))  # 8 -> 4
        x = nn.functional.max_pool2d(self.conv2(x), 3, 2, 0, 1, True)  # 4 -> 2 (ceil)
        return self.fc(torch.flatten(x, 1))


# ----------------------------------------------------------------------------- hardsigmoid

HS_TOLERANCE = 0.51  # units of the result's exponent, as Hardswish's (test_hardswish.py)
MANTISSAS = np.arange(-128, 128).astype(np.int8)


@pytest.mark.parametrize("e", [-20, -14, -9, -5, -3, -1, 0, 1, 4])
def test_hardsigmoid_is_torch_rounded_once(e: int) -> None:
    x = MX.of(MANTISSAS, e)
    ctx = RoundCtx("nearest", 0, 0, 8)
    y = K.hardsigmoid_forward(x, ctx, 0)
    xt = torch.from_numpy(_float(x)).requires_grad_()
    want = nn.functional.hardsigmoid(xt)
    assert np.abs(_float(y) - want.detach().numpy()).max() <= HS_TOLERANCE * 2.0 ** float(y.e)
    dy = MX.of(np.random.default_rng(e + 30).integers(-127, 128, 256).astype(np.int8), -5)
    want.backward(torch.from_numpy(_float(dy)))
    dx = K.hardsigmoid_backward(dy, x, ctx, 0)
    assert xt.grad is not None
    assert np.abs(_float(dx) - xt.grad.numpy()).max() <= HS_TOLERANCE * 2.0 ** float(dx.e)


def test_hardsigmoid_gradient_is_zero_at_the_breakpoints() -> None:
    """torch: dy / 6 strictly inside (-3, 3), 0 at -3 and 3 themselves."""
    x = MX.of(np.array([-48, -47, 47, 48], np.int8), -4)  # -3, -2.9375, 2.9375, 3
    dy = MX.of(np.full(4, 96, np.int8), -5)  # 3.0
    got = _float(K.hardsigmoid_backward(dy, x, RoundCtx("nearest", 0, 0, 8), 0))
    np.testing.assert_allclose(got, [0.0, 0.5, 0.5, 0.0], atol=2**-6)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("e", [-20, -13, -12, -4, 0, 3])
def test_hardsigmoid_kernels_equal_the_reference(e: int, rounding: str) -> None:
    """The accumulators of te_pool (before the shared division by 6) against the reference's:
    k above and below the 12-bit shift, and an exponent without a grid shift."""
    from mexc.kernels.activation import _divide_by_six
    from mexc.lowering import te_pool

    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    x = MANTISSAS.reshape(8, 32)
    acc, e_acc = _run(
        te_pool.hardsigmoid_acc(x.shape, "k"),
        x,
        _i32(e),
        outs=[(x.shape, "int32"), ((1,), "int32")],
    )
    got = _divide_by_six(acc.astype(np.int64), int(e_acc[0]), ctx, 5)
    want = K.hardsigmoid_forward(MX.of(x, e), ctx, 5)
    np.testing.assert_array_equal(got.m, want.m)
    assert int(got.e) == int(want.e)
    dy = np.random.default_rng(abs(e)).integers(-127, 128, x.shape).astype(np.int8)
    acc, e_acc = _run(
        te_pool.hardsigmoid_grad_acc(x.shape, "g"),
        dy,
        _i32(-6),
        x,
        _i32(e),
        outs=[(x.shape, "int32"), ((1,), "int32")],
    )
    got = _divide_by_six(acc.astype(np.int64), int(e_acc[0]), ctx, 6)
    want = K.hardsigmoid_backward(MX.of(dy, -6), MX.of(x, e), ctx, 6)
    np.testing.assert_array_equal(got.m, want.m)
    assert int(got.e) == int(want.e)


# ----------------------------------------------------------------------------- products x * g


@pytest.mark.parametrize(
    "x_shape,g_shape,view",
    [
        ((4, 8, 5, 5), (4, 8, 1, 1), (1, 32, 25)),
        ((4, 8, 5, 5), (8, 1, 1), (4, 8, 25)),
        ((4, 5, 5, 8), (8,), (100, 8, 1)),
        ((4, 8, 5, 5), (4, 8, 5, 5), (1, 800, 1)),
        ((4, 8, 5, 5), (4, 1, 1, 1), (1, 4, 200)),
        ((4, 8, 5, 5), (4, 1, 5, 5), None),
        ((4, 8, 5, 5), (1, 1, 1, 1), (800, 1, 1)),
    ],
)
def test_factor_view(x_shape, g_shape, view) -> None:
    assert K.factor_view(x_shape, g_shape) == view


def test_mul_is_torch_rounded_once_and_its_factor_gradient_exact() -> None:
    ctx = RoundCtx("nearest", 0, 0, 8)
    rng = np.random.default_rng(3)
    x = MX.of(rng.integers(-127, 128, (3, 4, 5, 5), dtype=np.int8), -5)
    g = MX.of(rng.integers(0, 128, (3, 4, 1, 1), dtype=np.int8), -7)
    y = K.mul_forward(x, g, ctx, 0)
    want = _float(x) * _float(g)
    assert np.abs(_float(y) - want).max() <= 0.5 * 2.0 ** float(y.e)
    dy = MX.of(rng.integers(-127, 128, x.m.shape, dtype=np.int8), -9)
    dg = K.mul_backward_factor(dy, x, (3, 4, 1, 1), ctx, 0, param=True)
    exact = (_float(dy) * _float(x)).sum(axis=(2, 3), keepdims=True)
    np.testing.assert_array_equal(dg.dequantize(), exact)  # 25 terms: no pre-shift


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize(
    "shape,g_axis",
    [((6, 40), 0), ((3, 8, 10), 1), ((48, 5), 1), ((16, 15), None), ((2, 3, 40000), 1)],
)
def test_mul_kernels_equal_the_reference(shape, g_axis, rounding: str) -> None:
    """mul_compaction and mul_factor_grad against the reference, on the kernels' views; the
    last case sums 80,000 terms per factor element: each product is first shifted right by
    mul_grad_shift = 1, rounded at site 1."""
    from mexc.kernels.elementwise import mul_grad_shift
    from mexc.lowering import te_ops

    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    rng = np.random.default_rng(len(shape) + (g_axis or 5))
    g_shape = (
        shape if g_axis is None else tuple(d if a == g_axis else 1 for a, d in enumerate(shape))
    )
    x = rng.integers(-127, 128, shape, dtype=np.int8)
    g = rng.integers(-127, 128, g_shape, dtype=np.int8)
    dy = rng.integers(-127, 128, shape, dtype=np.int8)
    stochastic = rounding == "stochastic"
    kernels = te_ops.mul_compaction(shape, g_axis, 8, stochastic, "k")
    m, e = _fused(
        kernels,
        [x, _i32(-4), g.reshape(-1) if g_axis is not None else g, _i32(-6)],
        _key(ctx, 7, 0),
        shape,
    )
    want = K.mul_forward(MX.of(x, -4), MX.of(g, -6), ctx, 7)
    np.testing.assert_array_equal(m, want.m)
    assert e == int(want.e)
    t = mul_grad_shift(x.size // g.size)
    assert (t == 1) == (x.size // g.size > 65536)
    acc_shape = shape if g_axis is None else (shape[g_axis],)
    acc, e_acc = _run(
        te_ops.mul_factor_grad(shape, g_axis, t, stochastic, "g"),
        dy,
        _i32(-8),
        x,
        _i32(-4),
        _key(ctx, 7, 1),
        outs=[(acc_shape, "int32"), ((1,), "int32")],
    )
    want_acc = K.mul_backward_factor(MX.of(dy, -8), MX.of(x, -4), g_shape, ctx, 7, param=True)
    np.testing.assert_array_equal(acc.reshape(g_shape), want_acc.a)
    assert int(e_acc[0]) == int(want_acc.e)


# ----------------------------------------------------------------------------- sigmoid, SiLU


@pytest.mark.parametrize("e", [-9, -6, -4, -2, 0, 3])
def test_sigmoid_and_silu_are_torch_within_their_tables(e: int) -> None:
    """The tables sample [-8, 8) at 1/16. With the index rounded to nearest, an input finer
    than the table moves by at most 2^-5: sigmoid (slope <= 1/4) is then within 2^-7, SiLU =
    x sigmoid(x) within |x| 2^-7, the derivatives (slopes <= 0.1 and 0.5) within 2^-6; past
    +-8 the clamped index keeps each within 0.003; plus the result's rounding."""
    ctx = RoundCtx("nearest", 0, 0, 8)
    x = MX.of(MANTISSAS, e)
    xf = _float(x)
    xt = torch.from_numpy(xf)
    step = 2.0**-5 if e < -4 else 0.0  # inputs on the table's grid need no index rounding
    sig = step / 4 + 0.0004
    for fwd, fn, slack in (
        (K.sigmoid_forward, torch.sigmoid, sig),
        (K.silu_forward, nn.functional.silu, np.abs(xf) * sig),
    ):
        y = fwd(x, ctx, 0)
        assert np.all(np.abs(_float(y) - fn(xt).numpy()) <= slack + 0.5 * 2.0 ** float(y.e))
    dy = MX.of(np.full(256, 64, np.int8), -6)  # 1.0
    for bwd, fn in ((K.sigmoid_backward, torch.sigmoid), (K.silu_backward, nn.functional.silu)):
        xg = xt.clone().requires_grad_()
        fn(xg).backward(torch.ones(256, dtype=torch.float64))
        dx = bwd(dy, x, ctx, 0)
        assert xg.grad is not None
        err = np.abs(_float(dx) - xg.grad.numpy())
        assert np.all(err <= step / 2 + 0.003 + 0.5 * 2.0 ** float(dx.e))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("e", [-9, -4, -1, 2, 9])
@pytest.mark.parametrize("which", ["sigmoid", "silu", "sigmoid_grad", "silu_grad"])
def test_table_product_kernels_equal_the_reference(which: str, e: int, rounding: str) -> None:
    from mexc.kernels.activation import table_product
    from mexc.lowering import te_ops
    from mexc.numerics import SIGMOID_GRAD_TABLE, SIGMOID_TABLE, SILU_GRAD_TABLE

    table = {"sigmoid": SIGMOID_TABLE, "silu": SIGMOID_TABLE}.get(
        which, SIGMOID_GRAD_TABLE if which == "sigmoid_grad" else SILU_GRAD_TABLE
    )
    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    x = MANTISSAS.reshape(8, 32)
    factor = which != "sigmoid"
    a = x if which == "silu" else np.random.default_rng(abs(e)).integers(-127, 128, x.shape)
    a = a.astype(np.int8)
    ea = e if which == "silu" else -6
    kernels = te_ops.table_product_compaction(
        x.shape, table.in_exp, table.out_exp, factor, 8, rounding == "stochastic", "k"
    )
    lead = [a, _i32(ea)] if factor else []
    inputs = [*lead, x, _i32(e), _key(ctx, 11, 0), table.values]
    m, e_out = _fused(kernels, inputs, _key(ctx, 11, 1), x.shape)
    want = table_product(MX.of(a, ea) if factor else None, MX.of(x, e), table, ctx, 11)
    np.testing.assert_array_equal(m, want.m)
    assert e_out == int(want.e)


class SwishNet(nn.Module):
    """EfficientNet's pieces: SiLU after batch norm, squeeze-and-excitation with SiLU and
    sigmoid gating, and torchvision's stochastic depth on a residual branch."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.ops import StochasticDepth

        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.SiLU()
        self.fc1 = nn.Conv2d(8, 4, 1)
        self.fc2 = nn.Conv2d(4, 8, 1)
        self.branch = nn.Conv2d(8, 8, 3, padding=1)
        self.drop = StochasticDepth(0.5, "row")
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.conv(x)))
        s = nn.functional.adaptive_avg_pool2d(x, 1)
        x = x * torch.sigmoid(self.fc2(nn.functional.silu(self.fc1(s))))
        x = x + self.drop(self.branch(x))
        return self.fc(torch.flatten(nn.functional.max_pool2d(x, 2), 1))


def test_stochastic_depth_keeps_or_drops_whole_samples() -> None:
    ctx = RoundCtx("stochastic", 5, 2, 8)
    x = MX.of(np.random.default_rng(0).integers(1, 127, (64, 3, 4, 4)).astype(np.int8), -4)
    per = K.elementwise.dropout_group(x.m.shape, "row")
    assert per == 48
    y, mask = K.dropout_forward(x, 0.5, ctx, 9, per)
    rows = mask.reshape(64, -1)
    assert np.all(rows == rows[:, :1])  # one decision per sample
    assert 16 < rows[:, 0].sum() < 48  # about half of 64 kept
    kept = rows[:, 0].astype(bool)
    np.testing.assert_array_equal(_float(y)[~kept], 0)
    np.testing.assert_allclose(_float(y)[kept], 2 * _float(x)[kept], rtol=0.02)


class FunctionalBatchNorm(nn.BatchNorm2d):
    """A BatchNorm2d subclass whose forward calls F.batch_norm on its own buffers (timm's
    BatchNormAct2d): traced through, into the function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
            self.momentum, self.eps,
        )  # fmt: skip


class GatedNet(nn.Module):
    """Squeeze-and-excitation with Hardsigmoid gating (MobileNetV3's), a layer-scale parameter
    [C, 1, 1] (ConvNeXt's) and one [C] seen through a reshape (timm's), a product of two
    activations of one shape, batch norm through F.batch_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = FunctionalBatchNorm(8)
        self.gamma = nn.Parameter(torch.full((8,), 0.75))
        self.fc1 = nn.Conv2d(8, 4, 1)
        self.fc2 = nn.Conv2d(4, 8, 1)
        self.gate = nn.Hardsigmoid()
        self.scale = nn.Parameter(torch.full((8, 1, 1), 0.5))
        self.other = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn(self.conv(x)))
        s = self.gate(self.fc2(torch.relu(self.fc1(nn.functional.adaptive_avg_pool2d(a, 1)))))
        y = self.scale * (a * s) * self.gamma.reshape(1, -1, 1, 1)
        y = y * nn.functional.hardsigmoid(self.other(x))
        return self.fc(torch.flatten(nn.functional.max_pool2d(y, 2), 1))


# ----------------------------------------------------------------------------- ViT pieces


class TokenNet(nn.Module):
    """timm's and torchvision's ViT pieces: a class token expanded over the batch and
    concatenated before the patch tokens, a positional parameter, F.scaled_dot_product_attention
    on heads from one qkv projection (reshape, permute, unbind), an nn.MultiheadAttention
    layer, F.layer_norm, and the class token read back with x[:, 0]."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 16, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.2)
        self.pos = nn.Parameter(torch.randn(1, 5, 16) * 0.1)
        self.qkv = nn.Linear(16, 48)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ln_w = nn.Parameter(torch.ones(16))
        self.ln_b = nn.Parameter(torch.zeros(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)  # [B, 4, 16]
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos
        b, n, d = t.shape
        q, k, v = self.qkv(t).reshape(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4).unbind(0)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        t = t + a.transpose(1, 2).reshape(b, n, d)
        t = t + self.mha(t, t, t, need_weights=False)[0]
        t = nn.functional.layer_norm(t, (d,), self.ln_w, self.ln_b)
        return self.head(t[:, 0])


MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...], set[Op]]] = {
    "tokens": (TokenNet, (1, 8, 8), {Op.EXPAND_PARAM, Op.CONCAT, Op.MATMUL, Op.LAYERNORM}),
    "gated": (
        GatedNet,
        (1, 8, 8),
        {Op.MUL, Op.MUL_GRAD, Op.HARDSIGMOID, Op.HARDSIGMOID_GRAD, Op.BATCHNORM},
    ),
    "concat": (CatNet, (1, 8, 8), {Op.CONCAT}),
    "ceil_pool": (CeilPoolNet, (1, 8, 8), {Op.MAXPOOL2D}),
}


if importlib.util.find_spec("torchvision") is not None:  # SwishNet's stochastic depth
    MODELS["swish"] = (SwishNet, (1, 8, 8), {Op.SILU, Op.SIGMOID, Op.SILU_GRAD, Op.SIGMOID_GRAD})


def test_timm_drop_path_is_stochastic_depth_per_sample() -> None:
    """timm's DropPath stays one node (its forward reads self.training, and tracing runs in
    eval mode): a row-mode dropout that the training step applies."""
    drop = pytest.importorskip("timm.layers.drop")

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.drop = drop.DropPath(0.25)
            self.head = nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.flatten(1)
            return self.head(x + self.drop(self.fc(x)))

    prog = mexc.compile(Residual(), (torch.zeros(8, 1, 4, 4),))
    (node,) = prog.graph.nodes_of(Op.DROPOUT)
    assert (node.attrs.p, node.attrs.mode) == (0.25, "row")


def _program(name: str, target: str) -> mexc.Program:
    cls, shape, _ = MODELS[name]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(cls(), (torch.zeros(4, *shape),), optimizer=opt, target=target)


def _train(name: str, prog: mexc.Program, steps: int = 3) -> list[str]:
    """The state checksum after every step."""
    shape = MODELS[name][1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *shape)).astype(np.float32) * 2
    y = rng.integers(0, 10, 4)
    checksums = []
    for _ in range(steps):
        prog.step(x, y)
        checksums.append(prog.state_checksum())
    return checksums


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_bit_exact_on_reference_llvm_and_c(name: str) -> None:
    ref = _program(name, "reference")
    assert MODELS[name][2] <= {n.op for n in ref.graph.nodes}
    if name == "ceil_pool":
        assert all(tuple(n.attrs.extra) == (1, 1) for n in ref.graph.nodes_of(Op.MAXPOOL2D))
    want = _train(name, ref)
    assert len(set(want)) == 3  # the state changes every step
    assert _train(name, _program(name, "llvm")) == want
    assert _train(name, _program(name, "c")) == want


@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_bit_exact_from_its_cuda_source(name: str, tmp_path: Path) -> None:
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import ORDER_LAYOUT, compare

    build_step(_program(name, "reference"), ("sm_80",), tmp_path, cubins=False)
    for order in ("forward", "reverse"):
        rows = compare(tmp_path, 2, order == "reverse", layout=ORDER_LAYOUT[order])
        assert all(r["exact"] for r in rows), rows


class _AsNet(nn.Module):
    """A conv, its output flattened, then reshaped through `reshape_as` / `view_as` (LeViT's
    and others' idiom) or through `reshape`."""

    def __init__(self, like: bool) -> None:
        super().__init__()
        self.like = like
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        flat = torch.flatten(y, 1)
        if self.like:
            return self.fc(y.reshape_as(flat).relu().view_as(flat))
        return self.fc(y.reshape(flat.shape).relu().view(flat.shape))


def test_reshape_as_and_view_as_are_reshapes() -> None:
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 4)
    sums = []
    for like in (True, False):
        torch.manual_seed(0)
        prog = mexc.compile(_AsNet(like), (torch.zeros(4, 1, 8, 8),), target="reference")
        assert [n.op for n in prog.graph.nodes].count(Op.RESHAPE) >= 3
        sums.append([(prog.step(x, y), prog.state_checksum()) for _ in range(2)])
    assert sums[0] == sums[1]


class ColumnNormalizedConv(nn.Conv2d):
    """A weight normalized by F.batch_norm over each input column (w.reshape(O, -1) is O
    samples of C KH KW features), not over each output channel's row as weight
    standardization's (tests/compiler/test_standardized_weights.py) is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = nn.functional.batch_norm(
            self.weight.reshape(self.out_channels, -1), None, None, training=True, eps=1e-6
        ).reshape_as(self.weight)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)


def test_a_weight_normalized_otherwise_is_refused_by_name() -> None:
    """A batch norm of a parameter in another form than weight standardization's names the
    parameter and the form mexc takes, not the running statistics it lacks."""
    model = nn.Sequential(ColumnNormalizedConv(1, 4, 3), nn.Flatten(), nn.Linear(144, 10))
    with pytest.raises(UnsupportedOpError, match=r"normalizes the parameter 0\.weight .* other"):
        mexc.compile(model, (torch.zeros(2, 1, 8, 8),))
