"""The SGD-with-momentum update as TIR kernels: the llvm build, launched in plan order, equals
numerics.sgd_momentum_update bit for bit; the CUDA build of the same TIR has no float."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import tvm
from test_cuda_products import needs_cuda_tools

from mexc.backends.cuda.nvcc import compile_cubin, float_opcodes, sass_opcodes
from mexc.backends.cuda.products import cuda_source
from mexc.backends.cuda.runtime import ARCHS
from mexc.backends.cuda.schedule import schedule_gpu
from mexc.lowering.te_update import KEY_VIEWS, UpdateSpec, update_buffers, update_kernels
from mexc.numerics import FixedScalar, UpdateConfig, sgd_momentum_update, update_keys

DEV = tvm.cpu()
MOMENTUM = FixedScalar.of(0.9)


def _symbol(func: tvm.tirx.PrimFunc) -> str:
    return str(func.attrs["global_symbol"])


@cache
def _built(spec: UpdateSpec) -> tvm.runtime.Module:
    funcs = {_symbol(k.func): k.func for k in update_kernels(spec)}
    return tvm.compile(tvm.IRModule(funcs), target="llvm")


def _run_on_host(spec: UpdateSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Launch the kernels in order on named host buffers; returns every buffer."""
    bufs = {n: tvm.runtime.empty(s, dt, DEV) for n, (s, dt) in update_buffers(spec).items()}
    for n, a in inputs.items():
        bufs[n] = tvm.runtime.tensor(np.ascontiguousarray(a, dtype=bufs[n].dtype), DEV)
    for view, site in KEY_VIEWS.items():
        bufs[view] = tvm.runtime.tensor(inputs["keys"][site : site + 1].astype(np.int64), DEV)
    ex = _built(spec)
    for k in update_kernels(spec):
        ex[_symbol(k.func)](*[bufs[a] for a in k.args])
    return {n: b.numpy() for n, b in bufs.items()}


# (lr, w_exp, max |grad| bits, max |w|): typical (right shift ~17), larger lr with small weights
# (left shift ~7), tiny lr (right shift >= 32), two saturating left shifts (~45 and ~60; the
# largest |u| << shift passes 2^63 and wraps in int64 first, as in the reference), near-zero
# weights with a tiny update (the reactive rescale shifts left), an all-zero weight at exponent 0
# (it takes the update's exponent)
CASES = [
    (0.05, -7, 20, 127),
    (1.0, -25, 24, 127),
    (3e-5, -7, 10, 127),
    (0.5, -60, 30, 127),
    (0.05, -90, 20, 127),
    (1e-4, -7, 4, 3),
    (0.05, 0, 20, 0),
]
SHAPES = [(4, 3, 3, 3), (5, 7), (6,)]


def _state(rng: np.random.Generator, shape: tuple, groups: int, grad_bits: int, wmax: int):
    w = rng.integers(-wmax, wmax + 1, shape).astype(np.int8)
    grad = rng.integers(-(2**grad_bits), 2**grad_bits, shape).astype(np.int32)
    v = rng.integers(-127, 128, shape).astype(np.int8)
    v_exp = rng.integers(-16, -4, groups).astype(np.int64)
    return w, grad, v, v_exp


# both forms of the whole-tensor maxima (UpdateSpec.rows_first: the GPU's, row by row first;
# the host's, one pass), each with one rounding mode
@pytest.mark.parametrize(("rounding", "rows_first"), [("stochastic", True), ("nearest", False)])
@pytest.mark.parametrize("wd", [0.0, 1e-2])
@pytest.mark.parametrize("per_group", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_update_matches_reference(
    shape: tuple, per_group: bool, wd: float, rounding: str, rows_first: bool
):
    bits = 8
    spec = UpdateSpec(
        shape,
        bits,
        per_group,
        MOMENTUM,
        FixedScalar.of(wd),
        rounding == "stochastic",
        rows_first=rows_first,
    )
    rng = np.random.default_rng(len(shape) * 10 + per_group)
    signs = set()
    for i, (lr, w_exp, grad_bits, wmax) in enumerate(CASES):
        w, grad, v, v_exp = _state(rng, shape, spec.groups, grad_bits, wmax)
        grad_exp = -20 - i
        cfg = UpdateConfig(bits, FixedScalar.of(lr), MOMENTUM, FixedScalar.of(wd), rounding)
        keys = update_keys(7, i, 48)
        want_w, want_we, want_v, want_ve = sgd_momentum_update(
            w, w_exp, grad, grad_exp, v, v_exp, cfg, keys
        )
        got = _run_on_host(
            spec,
            {
                "w": w,
                "w_exp": np.array([w_exp]),
                "grad": grad,
                "grad_exp": np.array([grad_exp]),
                "v": v,
                "v_exp": v_exp,
                "lr": np.array([cfg.lr.num, cfg.lr.shift]),
                "keys": np.array(keys, np.int64),
            },
        )
        np.testing.assert_array_equal(got["v_out"], want_v, err_msg=f"case {i}")
        np.testing.assert_array_equal(got["v_exp_out"], want_ve, err_msg=f"case {i}")
        np.testing.assert_array_equal(got["w_out"], want_w, err_msg=f"case {i}")
        assert int(got["w_exp_out"][0]) == want_we, f"case {i}"
        signs |= set(np.sign(w_exp - (want_ve - cfg.lr.shift)).tolist())
        signs.add(int(np.sign(want_we - w_exp)))  # the rescale's direction
    assert {-1, 1} <= signs  # both alignment directions and both rescale directions occurred


SPECS = [  # rows_first: the GPU plan's form
    UpdateSpec((64, 32, 3, 3), 8, True, MOMENTUM, FixedScalar.of(5e-4), True, rows_first=True),
    UpdateSpec((10,), 8, False, MOMENTUM, FixedScalar.of(0.0), False, rows_first=True),
]


@needs_cuda_tools
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=["conv-wd-stochastic", "bias-nearest"])
def test_update_compiles_for_cuda_without_float(spec: UpdateSpec, arch: str, tmp_path: Path):
    kernels = update_kernels(spec)
    funcs = {
        _symbol(k.func): schedule_gpu(k.func).with_attr("global_symbol", _symbol(k.func))
        for k in kernels
    }
    cu = tmp_path / "update.cu"
    cu.write_text(cuda_source(funcs, arch))
    sass = sass_opcodes(compile_cubin(cu, arch, tmp_path / "update.cubin"))
    for name in funcs:
        assert any(k.startswith(f"{name}_kernel") for k in sass), name
    for name, ops in sass.items():
        assert not float_opcodes(ops), (name, float_opcodes(ops))
