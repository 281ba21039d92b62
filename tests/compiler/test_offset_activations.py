"""ELU, CELU, SELU and Softplus as relu(x) + offset(x), the offset an integer table of x, and
PReLU as relu(x) + a min(x, 0) (docs/layers.md): the pieces against torch's float op in both
directions, the TIR kernels against the reference, parameter checks, and a model of all five
trained bit-exact on every backend: reference, llvm, C, and the CUDA artifact's own source on
the CPU emulator."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from mexc.mx import MX, RoundCtx
from mexc.numerics import offset_tables
from mexc.ops import REGISTRY
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
)
from tests.compiler.helpers import one_i32 as _i32
from tests.compiler.helpers import run_fused as _fused
from tests.compiler.helpers import site_key_buffer as _key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

NEAREST = RoundCtx("nearest", 0, 0, 8)
MANTISSAS = np.arange(-128, 128).astype(np.int8)

# (fn, params, torch's function, the offset's largest slope, its largest value's scale)
CASES = [
    ("elu", (1.0,), lambda t: F.elu(t), 1.0, 1.0),
    ("elu", (0.25,), lambda t: F.elu(t, 0.25), 0.25, 0.25),
    ("celu", (0.5,), lambda t: F.celu(t, 0.5), 1.0, 0.5),
    ("celu", (3.0,), lambda t: F.celu(t, 3.0), 1.0, 3.0),
    ("softplus", (1.0, 20.0), lambda t: F.softplus(t), 0.5, 1.0),
    ("softplus", (4.0, 20.0), lambda t: F.softplus(t, 4.0), 0.5, 0.25),
]


def _float(v: MX) -> np.ndarray:
    return v.m.astype(np.float64) * 2.0 ** float(v.e)


@pytest.mark.parametrize("e", [-9, -6, -4, -2, 0, 2])
@pytest.mark.parametrize(("fn", "params", "torch_fn", "slope", "size"), CASES)
def test_relu_plus_offset_is_torch_within_its_table(
    fn: str, params: tuple[float, ...], torch_fn: object, slope: float, size: float, e: int
) -> None:
    """relu(x) + offset(x) against torch: an input finer than the table's grid moves its index
    by half a step at most, or by a whole one for a positive input below the first step
    (sign-exact tables read entry 1 there), the offset's slope times that; past the table's
    range the clamped index leaves the offset within 3.4e-4 of its limit (relative to its
    scale); plus the offset's own rounding. The derivative the same way (its slope at most
    1 / scale)."""
    table, grad = offset_tables(fn, params)
    x = MX.of(MANTISSAS, e)
    xf = _float(x)
    step = 2.0**table.in_exp
    moved = np.where((xf > 0) & (xf < step), step, step / 2) if e < table.in_exp else 0.0
    y = K.offset_forward(x, fn, params, NEAREST, 0)
    got = np.maximum(xf, 0.0) + _float(y)
    want = torch_fn(torch.from_numpy(xf)).numpy()  # type: ignore[operator]
    slack = slope * moved + 3.4e-4 * size + 0.5 * 2.0 ** float(y.e) + 1e-12
    assert np.all(np.abs(got - want) <= slack), np.abs(got - want).max()
    xg = torch.from_numpy(xf).requires_grad_()
    torch_fn(xg).backward(torch.ones(256, dtype=torch.float64))  # type: ignore[operator]
    assert xg.grad is not None
    dy = MX.of(np.full(256, 64, np.int8), -6)  # 1.0
    dx = K.offset_backward(dy, x, fn, params, NEAREST, 0)
    relu_grad = (xf > 0).astype(np.float64)
    err = np.abs(relu_grad + _float(dx) - xg.grad.numpy())
    assert np.all(err <= moved / size + 3.4e-4 + 0.5 * 2.0 ** float(dx.e)), err.max()


def test_tables_follow_torch_definitions_at_their_grid_points() -> None:
    """Softplus's threshold is torch's (linear past beta x > threshold, derivative 1); the
    tables of equal functions are one table, with a C identifier for a name."""
    table, grad = offset_tables("softplus", (2.0, 1.0))
    xs = (np.arange(-128, 128) * 2.0**table.in_exp).astype(np.float64)
    past = 2.0 * xs > 1.0
    assert np.all(table.values[past] == 0) and np.all(table.values[~past & (xs > 0)] > 0)
    assert np.all(grad.values[past] == 0)  # 1 - relu's 1
    assert offset_tables("elu", (1.0,))[0] is offset_tables("elu", (1,))[0]
    assert table.name == "softplus_2p0_1p0" and grad.name == "softplus_2p0_1p0_grad"
    elu = offset_tables("elu", (1.0,))[0]
    want = np.expm1(np.minimum(np.arange(-128, 128) / 16.0, 0.0)) * 2.0**15
    np.testing.assert_array_equal(elu.values, np.floor(want + 0.5).astype(np.int32))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("which", ["forward", "grad"])
def test_offset_kernels_equal_the_reference(which: str, rounding: str) -> None:
    from mexc.kernels.activation import table_product
    from mexc.lowering import te_ops

    table = offset_tables("celu", (0.5,))[which == "grad"]
    ctx = RoundCtx(rounding, 3, 1, 8)  # type: ignore[arg-type]
    x = MANTISSAS.reshape(8, 32)
    factor = which == "grad"
    a = np.random.default_rng(1).integers(-127, 128, x.shape).astype(np.int8)
    kernels = te_ops.table_product_compaction(
        x.shape, table.in_exp, table.out_exp, factor, 8, rounding == "stochastic", "k"
    )
    lead = [a, _i32(-6)] if factor else []
    inputs = [*lead, x, _i32(-5), _key(ctx, 11, 0), table.values]
    m, e_out = _fused(kernels, inputs, _key(ctx, 11, 1), x.shape)
    want = table_product(MX.of(a, -6) if factor else None, MX.of(x, -5), table, ctx, 11)
    np.testing.assert_array_equal(m, want.m)
    assert e_out == int(want.e)


def test_registry_defines_the_offset_on_every_backend() -> None:
    for op in (Op.ACTIVATION_OFFSET, Op.ACTIVATION_OFFSET_GRAD):
        assert all(REGISTRY[op].supports(b) for b in ("reference", "llvm", "cuda", "c")), op


class ExpFamilyNet(nn.Module):
    """ELU after batch norm, PReLU per channel and shared, SELU, CELU and Softplus as modules
    and functions, over convolutions and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.elu = nn.ELU()
        self.prelu = nn.PReLU(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.softplus = nn.Softplus(beta=2.0)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.prelu_one = nn.PReLU()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prelu(self.elu(self.bn(self.conv1(x))))
        x = F.max_pool2d(F.selu(self.conv2(x)) + self.softplus(x), 2)
        return self.fc2(self.prelu_one(F.celu(self.fc1(torch.flatten(x, 1)), 0.5)))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        ExpFamilyNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    fns = {str(n.attrs.fn) for n in ref.graph.nodes_of(Op.ACTIVATION_OFFSET)}
    assert fns == {"elu", "celu", "softplus"}
    assert len(list(ref.graph.nodes_of(Op.ACTIVATION_OFFSET_GRAD))) == 4
    assert_trains_bit_exact_on_llvm_and_c(ref, lambda t: _program(t, bits))


def test_model_logits_match_torch() -> None:
    """The integer logits against torch's float64 ones on the program's own weights."""
    torch.manual_seed(0)
    model = ExpFamilyNet()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    assert_logits_match_torch(model, prog, x)


@pytest.mark.parametrize(
    "act",
    [nn.ELU(), nn.SELU(), nn.CELU(0.5), nn.Softplus(), nn.Softplus(2.0), nn.PReLU(16)],
    ids=["elu", "selu", "celu", "softplus", "softplus2", "prelu"],
)
def test_gradients_through_the_activation_match_autograd(act: nn.Module) -> None:
    """Linear, the activation, Linear at batch 64: every parameter's integer gradient (the
    first layer's through the activation's backward, PReLU's slopes) has cosine >= 0.99 with
    torch's on the program's weights (ReLU there: 0.993 for the first weight)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), act, nn.Linear(16, 10))
    prog = mexc.compile(model, (torch.zeros(64, 16),), rounding="nearest")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    ints, floats = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert len(ints) == (5 if isinstance(act, nn.PReLU) else 4)
    low = {k: cosine(ints[k], floats[k]) for k in ints if cosine(ints[k], floats[k]) < 0.99}
    assert not low, low


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)


@pytest.mark.parametrize(
    ("layer", "says"),
    [
        (nn.ELU(alpha=1e-3), "alpha 0.001"),
        (nn.CELU(alpha=-1.0), "alpha -1.0"),
        (nn.Softplus(beta=1000.0), "beta 1000.0"),
        (nn.Softplus(threshold=-1.0), "threshold -1.0"),
    ],
)
def test_parameters_out_of_range_are_refused_by_name(layer: nn.Module, says: str) -> None:
    model = nn.Sequential(nn.Linear(4, 8), layer, nn.Linear(8, 3))
    with pytest.raises(UnsupportedOpError) as err:
        mexc.compile(model, (torch.zeros(2, 4),))
    assert says in str(err.value) and "'_1'" in str(err.value)


def test_selu_is_scaled_elu() -> None:
    """SELU is torch's constants: the ELU offset at alpha 1.6733 under a scale of 1.0507."""
    model = nn.Sequential(nn.Linear(4, 8), nn.SELU(), nn.Linear(8, 3))
    prog = mexc.compile(model, (torch.zeros(2, 4),))
    (off,) = prog.graph.nodes_of(Op.ACTIVATION_OFFSET)
    assert math.isclose(float(off.attrs.params[0]), 1.6732632423543772)
    scales = [float(n.attrs.value) for n in prog.graph.nodes_of(Op.SCALE)]
    assert any(math.isclose(s, 1.0507009873554805) for s in scales)
