"""The tensor ops of a ViT in the shared TIR lowering (llvm and CUDA): transpose, slice and its
gradient, scaling by a constant, the broadcast parameter add and its gradient, the mean over
tokens and its gradient, GELU and its gradient. Their kernels against mexc.kernels at the
exponents where the recipes branch, and small models that use exactly these ops (plus already
lowered ones) trained bit-exact against the reference after every step, on llvm and on the CUDA
artifact's own source (the CPU emulator, both launch orders)."""

from __future__ import annotations

import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc import kernels as K
from mexc.backends.llvm import float_check
from mexc.ir import Op
from mexc.kernels._common import site_key
from mexc.mx import MX, RoundCtx
from mexc.ops import REGISTRY
from tests.compiler.helpers import one_i32 as _i32
from tests.compiler.helpers import run_fused as _fused
from tests.compiler.helpers import run_kernel as _run
from tests.compiler.helpers import site_key_buffer as _key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

OPS = (
    Op.TRANSPOSE,
    Op.SLICE,
    Op.SLICE_GRAD,
    Op.SCALE,
    Op.SCALE_GRAD,
    Op.ADD_PARAM,
    Op.ADD_PARAM_GRAD,
    Op.MEAN_TOKENS,
    Op.MEAN_TOKENS_GRAD,
    Op.GELU,
    Op.GELU_GRAD,
)


def test_registry_lowers_the_tensor_ops_to_tir() -> None:
    for op in OPS:
        d = REGISTRY[op]
        assert all(d.supports(b) for b in ("reference", "llvm", "cuda", "c")), op


# ----------------------------------------------------------------------------- kernels


MANTISSAS = np.arange(-128, 128, dtype=np.int8).reshape(8, 32)
ROUNDINGS = ("stochastic", "nearest")
# GELU branches on its input's exponent: the table alone (e <= -5), the table continued by the
# asymptotes (-5 < e <= 2), max(x, 0) (e > 2); the index's shift is a right shift (e < -5) or a
# saturating left shift (e > -5)
GELU_EXPONENTS = (-40, -12, -5, 0, 2, 9)  # below, inside, at the edge of and past the table


@pytest.mark.parametrize("host_schedule", [False, True])
@pytest.mark.parametrize(
    "shape,dim,start,stop",
    [((5, 3, 12), 2, 0, 4), ((5, 3, 12), 2, 4, 8), ((5, 3, 12), 2, 8, 12), ((4, 9), 1, 2, 7)]
    + [((6, 5, 4), 1, 1, 3), ((6, 4), 0, 0, 5), ((4, 9), 1, 0, 9)],
)
def test_slice_grad_places_dy_in_zeros(
    shape: tuple[int, ...], dim: int, start: int, stop: int, host_schedule: bool
) -> None:
    """Every slice of a chunk along the last axis (the host partitions that loop at start and
    stop), one in the middle of a row, other axes, and the whole axis."""
    from mexc.lowering import te_transformer
    from mexc.lowering.cpu_gemm import schedule_parallel

    dy_shape = tuple(stop - start if a == dim else d for a, d in enumerate(shape))
    dy = np.random.default_rng(stop).integers(-127, 128, dy_shape).astype(np.int8)
    func = te_transformer.slice_grad(shape, dim, start, stop, "sg", host_schedule)
    (dx,) = _run(schedule_parallel(func) if host_schedule else func, dy, outs=[(shape, "int8")])
    want = np.zeros(shape, np.int8)
    want[tuple(slice(start, stop) if a == dim else slice(None) for a in range(len(shape)))] = dy
    np.testing.assert_array_equal(dx, want)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("e", GELU_EXPONENTS)
def test_gelu_kernels_equal_the_reference(e: int, rounding: str) -> None:
    """GELU and its gradient as TIR table products (x Phi(x), dy GELU'(x)) against the
    reference, at exponents from far below the table's (-40: every index 0) to far above it
    (9: every nonzero index saturated)."""
    from mexc.lowering import te_ops
    from mexc.numerics import GELU_GRAD_TABLE, GELU_PHI_TABLE

    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    shape = MANTISSAS.shape
    dy = np.random.default_rng(e + 50).integers(-128, 128, shape, dtype=np.int8)
    cases = [
        (GELU_PHI_TABLE, MANTISSAS, e, K.gelu_forward(MX.of(MANTISSAS, e), ctx, 32), 32),
        (GELU_GRAD_TABLE, dy, -7, K.gelu_backward(MX.of(dy, -7), MX.of(MANTISSAS, e), ctx, 48), 48),
    ]
    for table, a, ea, want, tid in cases:
        kernels = te_ops.table_product_compaction(
            shape, table.in_exp, table.out_exp, True, 8, rounding == "stochastic", "gelu"
        )
        inputs = [a, _i32(ea), MANTISSAS, _i32(e), _key(ctx, tid, 0), table.values]
        m, e_out = _fused(kernels, inputs, _key(ctx, tid, 1), shape)
        np.testing.assert_array_equal(m, want.m)
        assert e_out == int(want.e)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("value", [0.5, 1 / 3, 0.125, 0.35355, 3.0, 1000.0])
def test_scale_kernels_equal_the_reference(value: float, rounding: str) -> None:
    from mexc.lowering import te_transformer
    from mexc.numerics import FixedScalar

    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    s = FixedScalar.of(value)
    shape = MANTISSAS.shape
    kernels = te_transformer.scale_compaction(
        shape, s.num, s.shift, 8, rounding == "stochastic", "k"
    )
    m, e = _fused(kernels, [MANTISSAS, _i32(-4)], _key(ctx, 16, 0), shape)
    want = K.scale_forward(MX.of(MANTISSAS, -4), s, ctx, 16)
    np.testing.assert_array_equal(m, want.m)
    assert e == int(want.e)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("ex,ep", [(-5, -5), (-3, -9), (-9, -3), (-2, -40), (-40, -2), (4, -6)])
def test_add_param_kernels_equal_the_reference(ex: int, ep: int, rounding: str) -> None:
    from mexc.lowering import te_transformer

    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    rng = np.random.default_rng(ex - ep + 100)
    x = rng.integers(-128, 128, (4, 6, 5), dtype=np.int8)
    keys = np.array([site_key(ctx, 64, 0), site_key(ctx, 64, 1)], np.int64)
    # a positional embedding (1, 6, 5): x as (4, 30, 1); a bias per channel (1, 6, 1): (4, 6, 5)
    for view, omi in (((1, 6, 5), (4, 30, 1)), ((1, 6, 1), (4, 6, 5))):
        p = rng.integers(-128, 128, (omi[1],), dtype=np.int8)
        kernels = te_transformer.add_param_compaction(omi, 8, rounding == "stochastic", "k")
        rows = (omi[0], omi[1] * omi[2])
        inputs = [x.reshape(rows), _i32(ex), p, _i32(ep), keys]
        m, e = _fused(kernels, inputs, _key(ctx, 64, 2), rows)
        want = K.add_broadcast_forward(MX.of(x, ex), MX.of(p, ep), ctx, 64, view)
        np.testing.assert_array_equal(m.reshape(x.shape), want.m)
        assert e == int(want.e)


# ----------------------------------------------------------------------------- models


class TensorOps(nn.Module):
    """Patch embedding to 12 tokens, + a positional parameter, a token-wise Linear, GELU, the
    features chunked in three, one chunk split into heads and back (4-D transposes),
    the chunks scaled and summed, the tokens chunked, the mean over tokens, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 16, 2, stride=2)
        self.pos = nn.Parameter(torch.randn(1, 12, 16) * 0.1)
        self.fc = nn.Linear(16, 48)
        self.act = nn.GELU()
        self.mix = nn.Linear(16, 16)
        self.mix2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2) + self.pos  # [B, 12, 16]
        a, b, c = self.act(self.fc(t)).chunk(3, dim=-1)  # 16 features each
        bb, tt, dd = c.shape
        heads = c.view(bb, tt, 2, 8).permute(0, 2, 1, 3)  # [B, 2, 12, 8]
        c = heads.transpose(1, 2).reshape(bb, tt, dd)
        y = self.mix(c) * 0.5 + self.mix2(a + b) / 3.0
        first, _ = y.chunk(2, dim=1)  # the first 6 tokens
        return self.head(first.mean(dim=1))


class ManyTokens(nn.Module):
    """289 tokens: the token mean's sum needs more than 15 bits (compact_to_bits, then the
    division by 289 = 17^2). The patch embedding starts near its bias, so that the tokens are
    near-equal mantissas above 113 and the sum passes 2^15 (a shift of 1 that rounds)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 4, 2, stride=2)
        self.head = nn.Linear(4, 10)
        with torch.no_grad():
            self.patch.weight.mul_(1e-3)
            self.patch.bias.fill_(0.9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(nn.functional.gelu(tokens.mean(dim=1)))


MODELS = {"tensor_ops": (TensorOps, (4, 1, 6, 8)), "many_tokens": (ManyTokens, (2, 1, 34, 34))}


def _program(name: str, target: str, **options: object) -> mexc.Program:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(cls(), (torch.zeros(shape),), optimizer=opt, target=target, **options)


def _batch(name: str) -> tuple[np.ndarray, np.ndarray]:
    shape = MODELS[name][1]
    rng = np.random.default_rng(0)
    return rng.standard_normal(shape).astype(np.float32) * 2, rng.integers(0, 10, shape[0])


def _train(prog: mexc.Program, name: str, steps: int = 3) -> list[str]:
    """The state checksum after every step."""
    x, y = _batch(name)
    checksums = []
    for _ in range(steps):
        prog.step(x, y)
        checksums.append(prog.state_checksum())
    return checksums


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_trains_bit_exact_on_reference_and_llvm(name: str) -> None:
    ref = _program(name, "reference")
    ops = {n.op for n in ref.graph.nodes}
    lowered = set(OPS) if name == "tensor_ops" else {Op.TRANSPOSE, Op.GELU, Op.MEAN_TOKENS}
    assert lowered <= ops
    want = _train(ref, name)
    assert len(set(want)) == 3  # the state changes every step
    llvm = _program(name, "llvm")
    assert _train(llvm, name) == want
    if shutil.which("objdump") and platform.machine() == "x86_64":
        report = float_check.check_integer_only(llvm)  # raises on a float instruction
        assert report.floats == [] and report.missing == []


def test_gpu_plan_trains_bit_exact_on_the_host() -> None:
    """The plan for a GPU (devices.GPU: its GEMM strategy and capabilities), built for llvm."""
    from mexc.backends.llvm.step import LlvmProgram

    want = _train(_program("tensor_ops", "reference"), "tensor_ops")
    twin = LlvmProgram(_program("tensor_ops", "reference"), plan_device="gpu")
    assert _train(twin, "tensor_ops") == want


def test_many_tokens_sum_passes_15_bits() -> None:
    """ManyTokens takes the token mean's compact_to_bits path with a shift that rounds."""
    from tests.compiler.helpers import step_values

    prog = _program("many_tokens", "reference")
    values = step_values(prog, *_batch("many_tokens"))
    (mean,) = prog.graph.nodes_of(Op.MEAN_TOKENS)
    tokens = values[mean.inputs[0]].m.astype(np.int64)
    assert tokens.shape[1] == 289 and np.abs(tokens.sum(axis=1)).max() > 1 << 15


OPTIONS = [{"rounding": "nearest"}, {"bits": 6, "per_group_velocity": False}]


@pytest.mark.parametrize("options", OPTIONS, ids=["nearest", "6-bits"])
def test_model_trains_bit_exact_on_llvm_with_other_options(options: dict[str, object]) -> None:
    want = _train(_program("tensor_ops", "reference", **options), "tensor_ops")
    assert _train(_program("tensor_ops", "llvm", **options), "tensor_ops") == want


@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_trains_bit_exact_from_its_cuda_source(name: str, tmp_path: Path) -> None:
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import ORDER_LAYOUT, compare
    from mexc.backends.cuda.sass_check import verify_artifact

    manifest = build_step(_program(name, "reference"), ("sm_80",), tmp_path)
    assert verify_artifact(tmp_path, manifest) == []  # integer-only SASS
    for order in ("forward", "reverse"):
        rows = compare(tmp_path, 2, order == "reverse", layout=ORDER_LAYOUT[order])
        assert all(r["exact"] for r in rows), rows
