"""runtime/mexc_kernels_extra.c and mexc_kernels_misc.c vs activation.py (relu6), pool.py
(avgpool2d, global_avgpool) and elementwise.py (dropout and stochastic depth, products of two
tensors, concatenation), bit for bit."""

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
    "mexc_mul_forward": "i pipiuuuppu",
    "mexc_mul_backward_factor": "i pipiuuuupppu",
    "mexc_concat": "i upppuuppu",
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


# ----------------------------------------------------------------------------- zoo ops


@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_stochastic_depth_rows(lib, ci):
    """Dropout with one decision per sample (per = a sample's size)."""
    ctx = CTXS[ci]
    x = MX.of(np.random.default_rng(ci).integers(-127, 128, (16, 3, 5)), -3)
    ref, mask = K.dropout_forward(x, 0.5, ctx, 80, 15)
    pf = FixedScalar.of(0.5)
    s = dropout_scale(pf)
    y, m = _out(x.m.shape), np.zeros(x.m.shape, np.uint8)
    drop = (1 << 32) - _keep_threshold(pf)
    e = lib.mexc_dropout_forward(
        P(i8(x.m)), -3, x.m.size, drop, Fixed(s.num, s.shift), P(y), P(m), C.byref(ctx_of(ctx)),
        80, 15,
    )  # fmt: skip
    assert e == int(ref.e) and np.array_equal(y, ref.m) and np.array_equal(m.astype(bool), mask)


@pytest.mark.parametrize("ci", range(len(CTXS)))
@pytest.mark.parametrize("view", [(2, 3, 40000), (1, 12, 25), (5, 6, 1)])
def test_mul_and_its_factor_gradient(lib, view, ci):
    """x (o, m, inner) times g (m,); the factor's gradient sums o * inner terms: 80,000 in the
    first view, where each product is first shifted right by 1 (site 1)."""
    from mexc.kernels.elementwise import mul_grad_shift

    ctx, c_ctx = CTXS[ci], ctx_of(CTXS[ci])
    o, m, inner = view
    rng = np.random.default_rng(ci + m)
    x = MX.of(rng.integers(-127, 128, view), -4)
    g = MX.of(rng.integers(-127, 128, (1, m, 1)), -6)
    y = _out(view)
    e = lib.mexc_mul_forward(P(i8(x.m)), -4, P(i8(g.m)), -6, o, m, inner, P(y), C.byref(c_ctx), 3)
    ref = K.mul_forward(x, g, ctx, 3)
    assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, view), -8)
    t = mul_grad_shift(o * inner)
    assert (t == 1) == (o * inner > 65536)
    acc = np.zeros(m, np.int32)
    e = lib.mexc_mul_backward_factor(
        P(i8(dy.m)), -8, P(i8(x.m)), -4, o, m, inner, t, P(acc), None, C.byref(c_ctx), 5
    )
    want = K.mul_backward_factor(dy, x, (1, m, 1), ctx, 5, param=True)
    assert e == int(want.e) and np.array_equal(acc, want.a.ravel())
    dg = _out(m)
    e = lib.mexc_mul_backward_factor(
        P(i8(dy.m)), -8, P(i8(x.m)), -4, o, m, inner, t, P(acc), P(dg), C.byref(c_ctx), 5
    )
    want = K.mul_backward_factor(dy, x, (1, m, 1), ctx, 5, param=False)
    assert e == int(want.e) and np.array_equal(dg, want.m.ravel())


@pytest.mark.parametrize("ci", range(len(CTXS)))
@pytest.mark.parametrize("exps", [(-5, -5, -5), (-3, -9, -4), (-40, -2, -9)])
def test_concat(lib, exps, ci):
    ctx, c_ctx = CTXS[ci], ctx_of(CTXS[ci])
    rng = np.random.default_rng(ci + 3)
    sizes = (3, 5, 2)
    xs = [i8(rng.integers(-127, 128, (4, k, 6))) for k in sizes]
    ref = K.concat_forward([MX.of(x, e) for x, e in zip(xs, exps)], 1, ctx, 9)
    ptrs = (C.c_void_p * 3)(*[x.ctypes.data for x in xs])
    es = np.array(exps, np.int32)
    ks = np.array(sizes, np.uint32)
    y = _out(ref.m.shape)
    e = lib.mexc_concat(3, ptrs, P(es), P(ks), 4, 6, P(y), C.byref(c_ctx), 9)
    assert e == int(ref.e) and np.array_equal(y, ref.m)
