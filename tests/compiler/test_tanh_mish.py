"""Tanh and Mish, two more activations through the integer table product (docs/layers.md,
docs/numerics.md section 9): each against torch's float op in both directions, the TIR kernels
against the reference, and a model with both trained bit-exact on every backend: reference,
llvm, C, and the CUDA artifact's own source on the CPU emulator."""

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
from mexc.numerics import MISH_GRAD_TABLE, MISH_TABLE, TANH_GRAD_TABLE, TANH_TABLE
from mexc.ops import REGISTRY
from tests.compiler.helpers import assert_cuda_source_trains_bit_exact, train_checksums
from tests.compiler.helpers import one_i32 as _i32
from tests.compiler.helpers import run_fused as _fused
from tests.compiler.helpers import site_key_buffer as _key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

NEAREST = RoundCtx("nearest", 0, 0, 8)
MANTISSAS = np.arange(-128, 128).astype(np.int8)


def _float(v: MX) -> np.ndarray:
    return v.m.astype(np.float64) * 2.0 ** float(v.e)


@pytest.mark.parametrize("e", [-9, -6, -5, -3, 0, 2])
def test_tanh_and_mish_are_torch_within_their_tables(e: int) -> None:
    """With the index rounded to nearest, an input finer than its table moves by at most half
    a step: tanh (slope <= 1, step 2^-5) within 2^-6, Mish = x m(x) (m's slope <= 0.6, step
    2^-4) within |x| 0.6 2^-5; the derivatives (slopes <= 0.77 and 0.9) within half a step
    times theirs; past the ranges the clamped index keeps tanh within 7e-4 and m within 4e-4
    (and Mish's derivative within 0.003); plus the result's rounding."""
    x = MX.of(MANTISSAS, e)
    xf = _float(x)
    xt = torch.from_numpy(xf)
    tanh_step = 2.0**-6 if e < -5 else 0.0  # inputs on a table's grid need no index rounding
    mish_step = 2.0**-5 if e < -4 else 0.0
    for fwd, fn, slack in (
        (K.tanh_forward, torch.tanh, tanh_step + 7e-4),
        (K.mish_forward, F.mish, np.abs(xf) * (0.6 * mish_step + 4e-4)),
    ):
        y = fwd(x, NEAREST, 0)
        assert np.all(np.abs(_float(y) - fn(xt).numpy()) <= slack + 0.5 * 2.0 ** float(y.e))
    dy = MX.of(np.full(256, 64, np.int8), -6)  # 1.0
    for bwd, fn, slack in (
        (K.tanh_backward, torch.tanh, 0.77 * tanh_step + 0.003),
        (K.mish_backward, F.mish, 0.9 * mish_step + 0.003),
    ):
        xg = xt.clone().requires_grad_()
        fn(xg).backward(torch.ones(256, dtype=torch.float64))
        dx = bwd(dy, x, NEAREST, 0)
        assert xg.grad is not None
        err = np.abs(_float(dx) - xg.grad.numpy())
        assert np.all(err <= slack + 0.5 * 2.0 ** float(dx.e)), err.max()


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("e", [-9, -4, 0, 3])
@pytest.mark.parametrize("which", ["tanh", "tanh_grad", "mish", "mish_grad"])
def test_table_product_kernels_equal_the_reference(which: str, e: int, rounding: str) -> None:
    from mexc.kernels.activation import table_product
    from mexc.lowering import te_ops

    table = {
        "tanh": TANH_TABLE,
        "tanh_grad": TANH_GRAD_TABLE,
        "mish": MISH_TABLE,
        "mish_grad": MISH_GRAD_TABLE,
    }[which]
    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    x = MANTISSAS.reshape(8, 32)
    factor = which != "tanh"
    rng = np.random.default_rng(abs(e))
    a = (x if which == "mish" else rng.integers(-127, 128, x.shape)).astype(np.int8)
    ea = e if which == "mish" else -6
    kernels = te_ops.table_product_compaction(
        x.shape, table.in_exp, table.out_exp, factor, 8, rounding == "stochastic", "k"
    )
    lead = [a, _i32(ea)] if factor else []
    inputs = [*lead, x, _i32(e), _key(ctx, 11, 0), table.values]
    m, e_out = _fused(kernels, inputs, _key(ctx, 11, 1), x.shape)
    want = table_product(MX.of(a, ea) if factor else None, MX.of(x, e), table, ctx, 11)
    np.testing.assert_array_equal(m, want.m)
    assert e_out == int(want.e)


def test_registry_defines_tanh_and_mish_on_every_backend() -> None:
    for op in (Op.TANH, Op.TANH_GRAD, Op.MISH, Op.MISH_GRAD):
        assert all(REGISTRY[op].supports(b) for b in ("reference", "llvm", "cuda", "c")), op


class TanhMishNet(nn.Module):
    """Mish as a module after batch norm (YOLOv4's CSP blocks), tanh as a method and as a
    function (a GAN generator's output, an MLP's hidden layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.Mish()
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.act(self.bn(self.conv(x))), 2).tanh()
        return self.fc2(torch.tanh(self.fc1(torch.flatten(F.mish(x), 1))))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        TanhMishNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    ops = {n.op for n in ref.graph.nodes}
    assert {Op.TANH, Op.TANH_GRAD, Op.MISH, Op.MISH_GRAD} <= ops
    want = train_checksums(ref)
    assert len(set(want)) == 3
    assert train_checksums(_program("llvm", bits)) == want
    assert train_checksums(_program("c", bits)) == want


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)


def test_gelu_tanh_approximation_lowers_to_the_integer_gelu() -> None:
    """Built from the tanh form, Phi's table would differ by at most 6 units of 2^-15 and the
    derivative's by 15 of 2^-14: x Phi(x) by at most 5.2e-4 on the table's range, below an int8
    step of GELU's output above 0.07 (docs/numerics.md section 9), so nn.GELU(approximate="tanh")
    compiles to the one integer GELU."""
    import math

    from mexc.numerics import GELU_GRAD_TABLE, GELU_IN_EXP, GELU_PHI_TABLE, LookupTable

    k = math.sqrt(2 / math.pi)

    def phi(v: float) -> float:
        return 0.5 * (1 + math.tanh(k * (v + 0.044715 * v**3)))

    def df(v: float) -> float:
        t = math.tanh(k * (v + 0.044715 * v**3))
        return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v)

    p, g = GELU_PHI_TABLE, GELU_GRAD_TABLE
    table = LookupTable.build("gelu_tanh_phi", phi, GELU_IN_EXP, p.out_exp, p.lo, p.hi)
    grad = LookupTable.build("gelu_tanh_grad", df, GELU_IN_EXP, g.out_exp, g.lo, g.hi)
    assert np.abs(table.values - p.values).max() == 6
    assert np.abs(grad.values - g.values).max() == 15
    xs = (np.arange(256) - 128) * 2.0**GELU_IN_EXP
    assert np.abs(xs * (table.values - p.values)).max() * 2.0**p.out_exp <= 5.2e-4
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 3))
    g = mexc.compile(model, (torch.zeros(2, 4),), target="reference").graph
    assert Op.GELU in {n.op for n in g.nodes}
