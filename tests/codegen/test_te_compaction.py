"""Compaction as TVM TIR (the GPU epilogue): bit-exact with mexc.numerics.compact on the host,
and the CUDA schedule of the same TIR compiles with nvcc."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from hypothesis import given
from hypothesis import strategies as st
from test_cuda_products import needs_cuda_tools

from mexc.backends.cuda.nvcc import compile_cubin, float_opcodes, sass_opcodes
from mexc.backends.cuda.products import cuda_source
from mexc.backends.cuda.schedule import schedule_gpu
from mexc.lowering.te_compaction import compaction_apply, compaction_shift
from mexc.numerics import compact, shift_signed, stream_key

_BUILT: dict[tuple, tvm.runtime.Module] = {}


def _built(shape: tuple[int, ...], bits: int, grouped: bool, stochastic: bool):
    k = (shape, bits, grouped, stochastic)
    if k not in _BUILT:
        funcs = {
            "c_shift": compaction_shift(shape, bits, grouped, "c"),
            "c_apply": compaction_apply(shape, bits, grouped, stochastic, "c"),
        }
        _BUILT[k] = tvm.compile(tvm.IRModule(funcs), target="llvm")
    return _BUILT[k]


def compact_on_host(
    acc: np.ndarray, e_in: np.ndarray, bits: int, grouped: bool, rounding: str, key: int
):
    ex = _built(acc.shape, bits, grouped, rounding == "stochastic")
    dev = tvm.cpu()
    groups = acc.shape[0] if grouped else 1
    s = tvm.runtime.empty((groups,), "int32", dev)
    e_out = tvm.runtime.empty((groups,), "int32", dev)
    m = tvm.runtime.empty(acc.shape, "int8", dev)
    ex["c_shift"](tvm.runtime.tensor(acc, dev), tvm.runtime.tensor(e_in, dev), s, e_out)
    ex["c_apply"](tvm.runtime.tensor(acc, dev), s, tvm.runtime.tensor(np.array([key]), dev), m)
    return m.numpy(), e_out.numpy()


SHAPES = [(7,), (4, 5, 3), (6, 11), (3, 2, 4, 5)]


@given(
    shape=st.sampled_from(SHAPES),
    grouped=st.booleans(),
    bits=st.sampled_from([4, 6, 8]),
    rounding=st.sampled_from(["stochastic", "nearest"]),
    magnitude=st.integers(0, 31),
    seed=st.integers(0, 2**32 - 1),
)
def test_compaction_tir_matches_reference(
    shape: tuple[int, ...], grouped: bool, bits: int, rounding: str, magnitude: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    hi = (1 << magnitude) - 1
    acc = rng.integers(-hi, hi + 1, shape, dtype=np.int64).astype(np.int32)
    if hi and acc.size > 1:
        acc.flat[0], acc.flat[-1] = hi, -hi  # the extremes of the range
    groups = shape[0] if grouped else 1
    e_in = rng.integers(-30, 10, groups).astype(np.int32)
    key = stream_key(seed, 3, 17)
    m, e_out = compact_on_host(acc, e_in, bits, grouped, rounding, key)
    want_m, want_e = compact(
        acc.astype(np.int64), e_in if grouped else int(e_in[0]), bits, rounding, key, grouped
    )
    np.testing.assert_array_equal(m, want_m)
    np.testing.assert_array_equal(e_out.reshape(np.shape(want_e)), want_e)


@pytest.mark.parametrize("shift", [-6, -1, 0, 3, 31, 32])
def test_apply_shifts_left_for_a_negative_shift_as_the_weight_rescale_does(shift: int) -> None:
    """compaction_apply with s < 0 (the reactive rescale of numerics section 12 reuses it) is
    an exact left shift; s >= 0 rounds as numerics.shift_signed."""
    acc = (np.arange(-40, 40, dtype=np.int32) * (1 if shift < 0 else 99991)).reshape(8, 10)
    key = stream_key(5, 2, 40)
    ex = tvm.compile(
        tvm.IRModule({"c_apply": compaction_apply(acc.shape, 8, False, True, "c")}), target="llvm"
    )
    t = tvm.runtime.tensor
    m = t(np.zeros(acc.shape, np.int8))
    ex["c_apply"](t(acc), t(np.array([shift], np.int32)), t(np.array([key], np.int64)), m)
    want = shift_signed(acc.astype(np.int64), shift, "stochastic", key)
    np.testing.assert_array_equal(m.numpy(), np.clip(want, -127, 127))


def test_compaction_tir_uses_the_key() -> None:
    acc = (np.arange(60, dtype=np.int32) * 1013 - 30000).reshape(6, 10)
    e = np.zeros(1, np.int32)
    a, _ = compact_on_host(acc, e, 8, False, "stochastic", 1)
    b, _ = compact_on_host(acc, e, 8, False, "stochastic", 2)
    assert not np.array_equal(a, b)  # different keys, different roundings
    assert np.abs(a.astype(int) - b.astype(int)).max() == 1  # ... by at most one unit


@needs_cuda_tools
@pytest.mark.parametrize("grouped", [False, True])
def test_compaction_cuda_compiles(grouped: bool, tmp_path: Path) -> None:
    shape = (128, 16, 28, 28) if not grouped else (32, 16, 3, 3)
    funcs = {
        "k_shift": schedule_gpu(compaction_shift(shape, 8, grouped, "k")),
        "k_apply": schedule_gpu(compaction_apply(shape, 8, grouped, True, "k")),
    }
    funcs = {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}
    cu = tmp_path / "compaction.cu"
    cu.write_text(cuda_source(funcs, "sm_90"))
    kernels = sass_opcodes(compile_cubin(cu, "sm_90", tmp_path / "compaction.cubin"))
    assert "k_apply_kernel" in kernels and "k_shift_kernel" in kernels
    for name, ops in kernels.items():
        assert not float_opcodes(ops), (name, float_opcodes(ops))  # integer-only kernels


@pytest.mark.parametrize(
    "bits,magnitudes", [(4, (3, 19, 12, 0, 18)), (8, (3, 19, 12, 0, 18)), (2, (0, 30, 1, 29, 5))]
)
def test_rerounded_pieces_match_the_compaction_of_the_whole(
    bits: int, magnitudes: tuple[int, ...]
) -> None:
    """te_compaction.rerounded, compiled for the host: pieces rounded by their own shifts (the
    reference's shift_right with each piece's flat start), then again by the tensor's shift,
    give numerics.compact's mantissas; a piece at the tensor's shift stays as it is. B = 2
    with |acc| near 2^31: shifts of 31 - the split form's carry, no int32 wrap."""
    from mexc.lowering.te_compaction import rerounded
    from mexc.numerics import compaction_shift as shift_of
    from mexc.numerics import shift_right

    count, per, slot = 5, 96, 16
    rng = np.random.default_rng(bits)
    acc = np.concatenate([rng.integers(-(2**b), 2**b, per) for b in magnitudes])
    key = int(stream_key(9, 4, 77))
    s = int(shift_of(int(np.abs(acc).max()), bits))
    pieces = acc.reshape(count, per)
    sj = np.zeros((count, slot), np.int32)
    y = np.zeros((count, per), np.int8)
    for j in range(count):
        sj[j, 0] = int(shift_of(int(np.abs(pieces[j]).max()), bits))
        y[j] = shift_right(pieces[j], int(sj[j, 0]), "stochastic", key, start=j * per)
    assert sorted(set(sj[:, 0])) != [s]  # some pieces below the tensor's shift
    mod = tvm.compile(tvm.IRModule({"r": rerounded(count, per, slot, bits, "r")}), target="llvm")
    dev = tvm.cpu()
    out = tvm.runtime.empty((count, per), "int8", dev)
    args = [tvm.runtime.tensor(a, dev) for a in (y, sj, np.array([s], np.int32))]
    mod["r_reround"](*args, tvm.runtime.tensor(np.array([key], np.int64), dev), out)
    m, _ = compact(acc.astype(np.int32), 0, bits, "stochastic", key)
    assert np.array_equal(out.numpy().reshape(-1), m)


def test_where_writes_a_rounded_value_once_and_selects_like_the_reference() -> None:
    """`where` writes the larger of its b side and its condition once (a rounding's hash on the
    b side was written twice in every rounding kernel), and still picks a or b on the host."""
    from tvm import te, tirx

    from mexc.lowering.te_compaction import _nodes, shift_right32, where

    x = te.placeholder((8,), "int32", name="x")
    t = te.placeholder((8,), "int32", name="t")
    key, flat = tirx.const(5, "int64"), tirx.const(3, "int64")
    rounded = shift_right32(x[0], t[0], key, flat, True)
    big, cond = _nodes(rounded, 10_000), _nodes(t[0] >= 32, 10_000)
    picked = _nodes(where(t[0] >= 32, tirx.const(0, "int32"), rounded), 10_000)
    assert cond < 10 and big > 100
    assert big < picked < big + 4 * cond + 16  # b ^ ((a ^ b) & m) was over 2 * big
    small = _nodes(where(rounded > 0, tirx.const(1, "int32"), tirx.const(0, "int32")), 10_000)
    assert small < big + 20  # a large condition, small sides: the condition once

    out = te.compute((8,), lambda i: where(t[i] >= 32, tirx.const(0, "int32"), x[i] * x[i]))
    lib = tvm.compile(te.create_prim_func([x, t, out]), target="llvm")
    xs = np.arange(-4, 4, dtype=np.int32) * 1000
    ts = np.array([0, 31, 32, 33, 100, -1, 5, 40], dtype=np.int32)
    got = tvm.runtime.tensor(np.zeros(8, np.int32))
    lib(tvm.runtime.tensor(xs), tvm.runtime.tensor(ts), got)
    assert got.numpy().tolist() == np.where(ts >= 32, 0, xs * xs).tolist()
