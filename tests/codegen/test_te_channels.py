"""Channel exponents as TVM TIR (mexc.lowering.te_channels): bit-exact with
mexc.numerics.channel_compact on the host, for activations (axis 1, one exponent or one per
channel, rounded by both modes), a weight's rows (signed shifts) and max-pool's pass-through."""

from __future__ import annotations

import numpy as np
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from mexc.lowering.te_channels import channel_apply, channel_shift, row_max
from mexc.lowering.te_norm_split import channel_max
from mexc.numerics import channel_compact, natural_shift, stream_key

_BUILT: dict[tuple, tvm.runtime.Module] = {}
DEV = tvm.cpu()


def _arr(x: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(x), DEV)


def _run(
    acc: np.ndarray,
    e: np.ndarray,
    bits: int,
    stochastic: bool,
    key: int,
    *,
    rows: bool = False,
    passthrough: int = 0,
) -> tuple[np.ndarray, int]:
    shape = acc.shape
    channels = shape[0] if rows else shape[1]
    per = e.size > 1
    k = (shape, bits, stochastic, rows, passthrough, per)
    if k not in _BUILT:
        funcs = {
            "amax": row_max(shape, "c") if rows else channel_max(shape, "c_amax"),  # type: ignore[arg-type]
            "shift": channel_shift(
                channels, bits, "c", per_channel_exp=per, signed=rows, passthrough=passthrough
            ),
            "apply": channel_apply(shape, stochastic, "c", axis=0 if rows else 1, signed=rows),
        }
        _BUILT[k] = tvm.compile(
            tvm.IRModule({f.attrs["global_symbol"]: f for f in funcs.values()}), target="llvm"
        )
    ex = _BUILT[k]
    amax = tvm.runtime.empty((channels,), "int32", DEV)
    sh = tvm.runtime.empty((channels,), "int32", DEV)
    up = tvm.runtime.empty((channels,), "int32", DEV)
    e_out = tvm.runtime.empty((1,), "int32", DEV)
    m = tvm.runtime.empty(shape, "int8", DEV)
    a = _arr(acc.astype(np.int32))
    ex["c_amax"](a, amax)
    ex["c_shift"](amax, _arr(e.astype(np.int32)), sh, up, e_out)
    ex["c_apply"](a, sh, up, _arr(np.array([key], np.int64)), m)
    return m.numpy(), int(e_out.numpy()[0])


def _acc(seed: int, shape: tuple[int, ...], magnitude: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scales = 2.0 ** rng.integers(0, magnitude + 1, size=shape[1] if len(shape) == 3 else shape[0])
    axis_shape = (1, -1, 1) if len(shape) == 3 else (-1, 1)
    acc = rng.normal(size=shape) * scales.reshape(axis_shape)
    acc = np.clip(np.round(acc), -(2**30), 2**30).astype(np.int64)
    acc[:, 0] = 0 if len(shape) == 3 else acc[:, 0]  # an all-zero channel
    return acc


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(4, 5, 3), (2, 3, 1), (3, 6, 10)]),
    bits=st.sampled_from([2, 4, 6, 7]),
    stochastic=st.booleans(),
    magnitude=st.integers(0, 28),
    per_channel=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_activation_channels_match_reference(
    shape: tuple[int, int, int],
    bits: int,
    stochastic: bool,
    magnitude: int,
    per_channel: bool,
    seed: int,
) -> None:
    acc = _acc(seed, shape, magnitude)
    rng = np.random.default_rng(seed + 1)
    e = rng.integers(-20, 20, size=shape[1] if per_channel else 1)
    key = stream_key(seed, 3, 7)
    rounding = "stochastic" if stochastic else "nearest"
    m, e_out = _run(acc, e, bits, stochastic, key)
    ref = channel_compact(acc, e if per_channel else int(e[0]), bits, rounding, key, 1)
    assert ref is not None
    assert e_out == ref[1]
    np.testing.assert_array_equal(m, ref[0])
    assert np.abs(m).max() <= 127


def test_all_zero_keeps_the_plain_exponents() -> None:
    acc = np.zeros((2, 3, 4), np.int64)
    m, e_out = _run(acc, np.array([5]), 4, False, 0)
    assert e_out == 5 and not m.any()
    m, e_out = _run(acc, np.array([5, -2, 9]), 4, False, 0)
    assert e_out == 9 and not m.any()  # compact_common's max e_g


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(5, 7), (3, 1), (8, 12)]),
    bits=st.sampled_from([3, 4, 6]),
    stochastic=st.booleans(),
    magnitude=st.integers(0, 20),
    seed=st.integers(0, 2**31),
)
def test_weight_rows_match_the_signed_reference(
    shape: tuple[int, int], bits: int, stochastic: bool, magnitude: int, seed: int
) -> None:
    acc = _acc(seed, shape, magnitude)
    key = stream_key(seed, 1, 2)
    m, e_out = _run(acc, np.array([-9]), bits, stochastic, key, rows=True)
    ref = channel_compact(
        acc, -9, bits, "stochastic" if stochastic else "nearest", key, 0, signed=True
    )
    if ref is None:
        assert e_out == -9 and not m.any()
        return
    assert e_out == ref[1]
    np.testing.assert_array_equal(m, ref[0])
    # a small row grows by an exact left shift (natural_shift's negative side)
    assert natural_shift(np.array([1]), bits, True)[0] < 0


def test_passthrough_keeps_a_fitting_result() -> None:
    acc = np.arange(-60, 60).reshape(2, 3, 20)
    m, e_out = _run(acc, np.array([4]), 4, False, 0, passthrough=127)
    np.testing.assert_array_equal(m, acc)
    assert e_out == 4
    big = acc * 4  # above 127: the channel rule
    m, e_out = _run(big, np.array([4]), 4, False, 0, passthrough=127)
    ref = channel_compact(big, 4, 4, "nearest", 0, 1)
    assert ref is not None and e_out == ref[1]
    np.testing.assert_array_equal(m, ref[0])
