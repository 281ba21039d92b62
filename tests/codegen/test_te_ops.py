"""Non-product ops as TVM TIR: the llvm build equals mexc.kernels bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from test_cuda_products import needs_cuda_tools

from mexc.backends.cuda.nvcc import compile_cubin, float_opcodes, sass_opcodes
from mexc.backends.cuda.products import cuda_source
from mexc.backends.cuda.runtime import ARCHS
from mexc.backends.cuda.schedule import schedule_gpu
from mexc.kernels import (
    grad_sum,
    maxpool2d_backward,
    maxpool2d_forward,
    relu_backward,
    relu_forward,
    softmax_ce_backward,
    softmax_ce_forward,
)
from mexc.kernels._common import product_bits
from mexc.kernels.linear import add_bias
from mexc.kernels.loss import GRAD_EXP, ce_loss, grad_shift
from mexc.lowering import te_ops
from mexc.lowering.te_compaction import compaction_apply, compaction_shift
from mexc.mx import MX, RoundCtx
from mexc.numerics import EXP_TABLE

DEV = tvm.cpu()


def _run(func: tvm.tirx.PrimFunc, *arrays: np.ndarray, outs: list[tuple[tuple, str]]):
    ex = tvm.compile(func, target="llvm")
    out = [tvm.runtime.empty(shape, dtype, DEV) for shape, dtype in outs]
    ex(*[tvm.runtime.tensor(np.ascontiguousarray(a), DEV) for a in arrays], *out)
    return [o.numpy() for o in out]


def _rand(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-128, 128, shape, dtype=np.int8)


def test_relu_forward_and_backward() -> None:
    rng = np.random.default_rng(0)
    shape = (3, 4, 5, 6)
    x, dy = _rand(rng, shape), _rand(rng, shape)
    (y,) = _run(te_ops.relu_forward(shape), x, outs=[(shape, "int8")])
    np.testing.assert_array_equal(y, relu_forward(MX.of(x, -3)).m)
    (dx,) = _run(te_ops.relu_backward(shape), dy, x, outs=[(shape, "int8")])
    np.testing.assert_array_equal(dx, relu_backward(MX.of(dy, -5), MX.of(x, -3)).m)


POOLS = [
    ((2, 3, 8, 8), 2, None, 0),
    ((2, 2, 7, 9), 2, 2, 0),  # tiled windows, last row and column in no window
    ((1, 2, 9, 7), 3, None, 0),
    ((1, 2, 7, 9), 3, 2, 1),  # overlapping windows with padding
    ((2, 2, 6, 5), (3, 2), (1, 2), (1, 0)),
]


@pytest.mark.parametrize("shape,kernel,stride,padding", POOLS)
def test_maxpool_forward_and_backward(shape, kernel, stride, padding) -> None:
    rng = np.random.default_rng(sum(shape))
    # few distinct values: ties inside windows, where the first maximum must win
    x = rng.integers(-3, 4, shape, dtype=np.int8)
    ref_y, ref_arg = maxpool2d_forward(MX.of(x, -2), kernel, stride, padding)
    y_shape = ref_y.m.shape
    y, arg = _run(
        te_ops.maxpool_forward(shape, kernel, stride, padding),
        x,
        outs=[(y_shape, "int8"), (y_shape, "int32")],
    )
    np.testing.assert_array_equal(y, ref_y.m)
    np.testing.assert_array_equal(arg, ref_arg)

    dy = _rand(rng, y_shape)
    ctx = RoundCtx("stochastic", 5, 7, 8)
    want = maxpool2d_backward(MX.of(dy, -6), arg, shape, kernel, stride, padding, ctx, 32)
    (acc,) = _run(
        te_ops.maxpool_backward_acc(shape, kernel, stride, padding),
        dy,
        arg.astype(np.int32),
        outs=[(shape, "int32")],
    )
    # compaction (shift 0 when the sums fit in int8) with the reference's site-0 key
    s, e_out = _run(
        compaction_shift(shape, 8, False, "c"),
        acc,
        np.array([-6], np.int32),
        outs=[((1,), "int32"), ((1,), "int32")],
    )
    key = np.array([ctx.key(32)], np.int64)
    (m,) = _run(compaction_apply(shape, 8, False, True, "c"), acc, s, key, outs=[(shape, "int8")])
    np.testing.assert_array_equal(m, want.m)
    assert int(e_out[0]) == int(want.e)


def test_maxpool_forward_writes_y_directly_and_padding_never_wins() -> None:
    """No int32 window-max buffer between the taps and y (TVM allocated it as a batch-sized
    workspace outside the arena), and with every input at -128 a padded tap, also -128 in
    the int8 max, still never becomes the argmax."""
    shape, kernel, stride, padding = (2, 2, 5, 5), 3, 2, 1
    func = te_ops.maxpool_forward(shape, kernel, stride, padding)
    assert "alloc_buffer" not in func.script()
    x = np.full(shape, -128, np.int8)
    x[0, 1, 2, 3] = 5
    ref_y, ref_arg = maxpool2d_forward(MX.of(x, 0), kernel, stride, padding)
    y, arg = _run(func, x, outs=[(ref_y.m.shape, "int8"), (ref_y.m.shape, "int32")])
    np.testing.assert_array_equal(y, ref_y.m)
    np.testing.assert_array_equal(arg, ref_arg)
    assert int(arg[0, 0, 0, 0]) == 4  # the window's first input pixel: (1, 1) of 3 x 3


@needs_cuda_tools
def test_ops_compile_for_cuda_without_float(tmp_path: Path) -> None:
    shape = (128, 16, 28, 28)
    funcs = {
        "relu_f": te_ops.relu_forward(shape),
        "relu_b": te_ops.relu_backward(shape),
        "pool_f": te_ops.maxpool_forward(shape, 2),
        "pool_b": te_ops.maxpool_backward_acc(shape, 3, 2, 1),
        "add": te_ops.aligned_sum_acc(shape, 2, True),
    }
    funcs = {n: schedule_gpu(f).with_attr("global_symbol", n) for n, f in funcs.items()}
    cu = tmp_path / "ops.cu"
    cu.write_text(cuda_source(funcs, "sm_80"))
    kernels = sass_opcodes(compile_cubin(cu, "sm_80", tmp_path / "ops.cubin"))
    assert {"relu_f_kernel", "relu_b_kernel", "pool_b_kernel", "add_kernel"} <= set(kernels)
    # the window's max and its first index: short reductions, one thread per output, one
    # kernel (schedule._elementwise_runs)
    assert sum(k.startswith("pool_f_kernel") for k in kernels) == 1
    for name, ops in kernels.items():
        assert not float_opcodes(ops), (name, float_opcodes(ops))


@needs_cuda_tools
@pytest.mark.parametrize("arch", ARCHS)
def test_softmax_head_compiles_for_cuda_without_float(arch: str, tmp_path: Path) -> None:
    # the head divides by run-time row sums and row counts: te_divide's long division, since
    # nvcc's own integer division would bring MUFU.RCP / I2F / F2I into the SASS
    funcs = {
        "sm_f": te_ops.softmax_ce_forward(128, 10, True),
        "sm_fn": te_ops.softmax_ce_forward(128, 10, False),
        "sm_b": te_ops.softmax_ce_backward_acc(128, 10),
    }
    funcs = {n: schedule_gpu(f).with_attr("global_symbol", n) for n, f in funcs.items()}
    cu = tmp_path / "head.cu"
    cu.write_text(cuda_source(funcs, arch))
    kernels = sass_opcodes(compile_cubin(cu, arch, tmp_path / "head.cubin"))
    # rowmax, exp, sum, probs, loss rows
    assert sum(k.startswith("sm_f_kernel") for k in kernels) == 5
    assert sum(k.startswith("sm_fn_kernel") for k in kernels) == 5
    assert "sm_b_kernel" in kernels
    for name, ops in kernels.items():
        assert not float_opcodes(ops), (name, float_opcodes(ops))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("exps", [(-5, -5), (-3, -9), (-20, 4), (0, -40, -7)])
def test_aligned_sum_then_compaction_equals_grad_sum(rounding: str, exps: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(exps) * 100 + exps[1])
    shape = (4, 3, 5)
    terms = [MX.of(_rand(rng, shape), e) for e in exps]
    ctx = RoundCtx(rounding, 11, 3, 8)
    tid = 48
    want = grad_sum(terms, ctx, tid)
    t = len(exps)
    keys = np.array([ctx.key(tid + i) for i in range(t)], np.int64)
    target, acc = _run(
        te_ops.aligned_sum_acc(shape, t, rounding == "stochastic"),
        *[x.m for x in terms],
        np.array(exps, np.int32),
        keys,
        outs=[((1,), "int32"), (shape, "int32")],
    )
    s, e_out = _run(
        compaction_shift(shape, 8, False, "c"),
        acc,
        target,
        outs=[((1,), "int32"), ((1,), "int32")],
    )
    (m,) = _run(
        compaction_apply(shape, 8, False, rounding == "stochastic", "c"),
        acc,
        s,
        np.array([ctx.key(tid + t)], np.int64),
        outs=[(shape, "int8")],
    )
    np.testing.assert_array_equal(m, want.m)
    assert int(e_out[0]) == int(want.e)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("k", [192, 1 << 15, 1 << 17])  # 22, 29 (int32 lanes), 31 bits (int64)
def test_bias_add_equals_the_reference(rounding: str, k: int) -> None:
    """kernels.linear.add_bias: accumulators at both ends of their static bits, every shift
    direction of both terms (the exponents are run-time inputs of one kernel), in int32 lanes
    (at most 29 bits) and int64."""
    import tvm

    ex = tvm.compile(
        te_ops.bias_add_acc((6, 40), 1, product_bits(k), rounding == "stochastic"), target="llvm"
    )
    top = (1 << product_bits(k)) - 1
    for e_acc, e_b in [(-12, -6), (-12, -40), (-30, -2), (5, 5), (-3, 20)]:
        rng = np.random.default_rng(k + e_acc - e_b)
        acc = rng.integers(-top, top + 1, (6, 40), dtype=np.int64)
        acc[0, :3], acc[1, :3] = top, -top
        bias = MX.of(_rand(rng, (40,)).clip(-127, 127), e_b)
        ctx = RoundCtx(rounding, 5, 2, 8)
        want, e_want = add_bias(acc, e_acc, k, bias, 1, ctx, 17)
        keys = np.array([ctx.key(17 + 1), ctx.key(17 + 2)], np.int64)  # sites 1 and 2
        args = [acc.astype(np.int32), np.array([e_acc], np.int32), bias.m]
        args += [np.array([e_b], np.int32), keys]
        out = [
            tvm.runtime.empty(shape, dtype, DEV)
            for shape, dtype in [((1,), "int32"), ((6, 40), "int32")]
        ]
        ex(*[tvm.runtime.tensor(np.ascontiguousarray(a), DEV) for a in args], *out)
        assert int(out[0].numpy()[0]) == int(e_want), (e_acc, e_b)
        np.testing.assert_array_equal(out[1].numpy(), want, err_msg=f"{(e_acc, e_b)}")


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize(
    "e_logits,valid", [(-3, 16), (-6, 11), (-20, 16), (0, 5), (30, 16), (60, 7)]
)  # 30 and 60: the left shift of the table index saturates (60: shift capped at 54), and so
# does the label's gap; -20: the gap rounds to exponent -16
@pytest.mark.parametrize("host", [False, True])  # a row at a time (the llvm schedule)
def test_softmax_ce_forward_and_backward(
    rounding: str, e_logits: int, valid: int, host: bool
) -> None:
    rng = np.random.default_rng(abs(valid - e_logits))
    n, k = 16, 10
    logits = _rand(rng, (n, k))
    labels = rng.integers(0, k, n)
    ctx = RoundCtx(rounding, 2, 9, 8)
    tid = 80
    ctx_valid = valid
    want_p, want_loss = softmax_ce_forward(MX.of(logits, e_logits), labels, ctx_valid, ctx, tid)
    p, rows = _run(
        te_ops.softmax_ce_forward(n, k, rounding == "stochastic", host_schedule=host),
        logits,
        np.array([e_logits], np.int32),
        np.array([ctx.key(tid)], np.int64),
        EXP_TABLE.values.astype(np.int32),
        labels.astype(np.int32),
        outs=[((n, k), "int16"), ((n, 2), "int32")],
    )
    np.testing.assert_array_equal(p, want_p)
    assert ce_loss(rows, ctx_valid) == want_loss  # the same rows, so the same float

    want_g = softmax_ce_backward(want_p, labels, ctx_valid, ctx, tid + 16)
    shift = grad_shift(valid, k)
    (acc,) = _run(
        te_ops.softmax_ce_backward_acc(n, k, shift=shift, host_schedule=host),
        p,
        labels.astype(np.int32),
        np.array([valid, valid], np.int32),
        outs=[((n, k), "int32")],
    )
    s, e_out = _run(
        compaction_shift((n, k), 8, False, "c"),
        acc,
        np.array([GRAD_EXP - shift], np.int32),
        outs=[((1,), "int32"), ((1,), "int32")],
    )
    (m,) = _run(
        compaction_apply((n, k), 8, False, rounding == "stochastic", "c"),
        acc,
        s,
        np.array([ctx.key(tid + 16)], np.int64),
        outs=[((n, k), "int8")],
    )
    np.testing.assert_array_equal(m, want_g.m)
    assert int(e_out[0]) == int(want_g.e)


def test_bit_lengths_of_every_power_of_two_and_its_neighbours() -> None:
    """te_norm._bitlen (the six-step binary search) against Python's int.bit_length."""
    from tvm import te

    from mexc.lowering.te_norm import _bitlen

    values = [0, 1, -1, 2, 3, -5, 127]
    for k in range(2, 62):
        values += [(1 << k) - 1, 1 << k, (1 << k) + 1, -(1 << k)]
    v = np.array(values, np.int64)
    x = te.placeholder(v.shape, "int64", name="x")
    func = te.create_prim_func([x, _bitlen(x, "bl")])
    (got,) = _run(func, v, outs=[(v.shape, "int32")])
    np.testing.assert_array_equal(got, [abs(int(a)).bit_length() for a in values])
