"""runtime/mexc_kernels_extra.c vs activation.py (relu6), pool.py (avgpool2d, global_avgpool)
and elementwise.py (dropout), bit for bit."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from mexc import kernels as K
from mexc.kernels.elementwise import _keep_threshold, dropout_scale
from mexc.mx import MX
from mexc.numerics import FixedScalar
from tests.mcu.test_runtime_lib import CTXS, Fixed, P, PoolGeom, _sig, ctx_of, i8

SIGS = {
    "mexc_relu6_cap": "i i",
    "mexc_relu6_forward": "v pipu",
    "mexc_relu6_backward": "v ppipu",
    "mexc_avgpool2d_forward": "i ppippu",
    "mexc_avgpool2d_backward": "i ppippu",
    "mexc_global_avgpool_forward": "i uuupippu",
    "mexc_global_avgpool_backward": "i uuupippu",
    "mexc_mean_axis_forward": "i uuupippu",
    "mexc_mean_axis_backward": "i uuupippu",
    "mexc_dropout_forward": "i piuuFpppuu",
    "mexc_dropout_backward": "i pipuFppu",
}


@pytest.fixture(scope="module")
def lib(rt):
    for name, sig in SIGS.items():
        _sig(rt, name, sig)
    return rt


def _out(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, np.int8)


@pytest.mark.parametrize("e", [-9, -6, -5, -4, -3, -1, 0, 1, 2, 3, 5])
def test_relu6(lib, e):
    from mexc.kernels.activation import relu6_cap

    rng = np.random.default_rng(e + 20)
    x = MX.of(rng.integers(-127, 128, 700), e)
    dy = MX.of(rng.integers(-127, 128, 700), -6)
    assert lib.mexc_relu6_cap(e) == relu6_cap(e)
    y = _out(700)
    lib.mexc_relu6_forward(P(i8(x.m)), e, P(y), 700)
    ref = K.relu6_forward(x)
    assert np.array_equal(y, ref.m)
    for saved in (x, ref):  # the IR saves the output; the input works too
        dx = _out(700)
        lib.mexc_relu6_backward(P(i8(dy.m)), P(i8(saved.m)), e, P(dx), 700)
        assert np.array_equal(dx, K.relu6_backward(dy, saved).m)
    inplace = i8(dy.m).copy()  # dx over dy's bytes (plan-memory's in-place rule)
    lib.mexc_relu6_backward(P(inplace), P(i8(ref.m)), e, P(inplace), 700)
    assert np.array_equal(inplace, K.relu6_backward(dy, ref).m)


# (N, C, H, W, k, stride, padding); k = 17: 7 + ceil log2(289) > 15 -> compact_to_bits (site 0)
POOLS = [
    (2, 3, 8, 8, 2, 2, 0),
    (1, 2, 7, 7, 3, 2, 1),
    (2, 2, 6, 6, 3, 1, 1),
    (1, 2, 20, 20, 17, 3, 0),
    (1, 1, 5, 4, 2, 1, 0),
]


@pytest.mark.parametrize("cfg", POOLS)
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_avgpool2d(lib, cfg, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    n, c, h, w, k, s, p = cfg
    rng = np.random.default_rng(ci * 7 + h)
    geom = PoolGeom()
    lib.mexc_pool_init(C.byref(geom), n, c, h, w, k, k, s, s, p, p)
    x = MX.of(rng.integers(-127, 128, (n, c, h, w)), -4)
    ref = K.avgpool2d_forward(x, k, s, p, ctx, 32)
    y = _out(ref.m.shape)
    e = lib.mexc_avgpool2d_forward(C.byref(geom), P(i8(x.m)), -4, P(y), C.byref(c_ctx), 32)
    assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, ref.m.shape), -7)
    r = K.avgpool2d_backward(dy, x.shape, k, s, p, ctx, 48)
    dx = _out(x.shape)
    e = lib.mexc_avgpool2d_backward(C.byref(geom), P(i8(dy.m)), -7, P(dx), C.byref(c_ctx), 48)
    assert e == int(r.e) and np.array_equal(dx, r.m)


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (3, 5, 7, 7), (1, 4, 1, 1), (2, 2, 24, 24)])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_global_avgpool(lib, shape, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    n, c, h, w = shape
    rng = np.random.default_rng(ci + h)
    x = MX.of(rng.integers(-127, 128, shape), 2)
    ref = K.global_avgpool_forward(x, ctx, 16)
    y = _out(ref.m.shape)
    e = lib.mexc_global_avgpool_forward(n, c, h * w, P(i8(x.m)), 2, P(y), C.byref(c_ctx), 16)
    assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, (n, c, 1, 1)), -9)
    r = K.global_avgpool_backward(dy, shape, ctx, 64)
    dx = _out(shape)
    e = lib.mexc_global_avgpool_backward(n, c, h * w, P(i8(dy.m)), -9, P(dx), C.byref(c_ctx), 64)
    assert e == int(r.e) and np.array_equal(dx, r.m)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.3, 0.9])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_dropout(lib, p, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci)
    shape = (4, 5, 6)
    x = MX.of(rng.integers(-127, 128, shape), -3)
    ref, mask = K.dropout_forward(x, p, ctx, 80)
    pf = FixedScalar.of(p)
    drop = (1 << 32) - _keep_threshold(pf)
    s = dropout_scale(pf)
    fs = Fixed(s.num, s.shift)
    y, m = _out(shape), np.zeros(shape, np.uint8)
    e = lib.mexc_dropout_forward(
        P(i8(x.m)), -3, x.m.size, drop, fs, P(y), P(m), C.byref(c_ctx), 80, 1
    )
    assert e == int(ref.e) and np.array_equal(y, ref.m) and np.array_equal(m.astype(bool), mask)
    dy = MX.of(rng.integers(-127, 128, shape), -5)
    r = K.dropout_backward(dy, mask, p, ctx, 96)
    dx = _out(shape)
    e = lib.mexc_dropout_backward(P(i8(dy.m)), -5, P(m), x.m.size, fs, P(dx), C.byref(c_ctx), 96)
    assert e == int(r.e) and np.array_equal(dx, r.m)
