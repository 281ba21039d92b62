"""runtime/mexc_kernels_conv.c vs mexc/kernels/conv.py and linear.py, bit for bit."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from mexc import kernels as K
from mexc.mx import MX
from tests.mcu.test_runtime_lib import CTXS, ConvGeom, P, ctx_of, i8, i32, scratch  # noqa: F401

# (N, C, H, W, O, KH, KW, stride, padding, groups)
CONVS = [
    (2, 1, 8, 8, 8, 3, 3, 1, 1, 1),  # DigitsCNN conv1
    (2, 8, 4, 4, 16, 3, 3, 1, 1, 1),  # DigitsCNN conv2
    (1, 4, 7, 6, 6, 3, 2, 2, 1, 2),  # groups, stride, odd sizes
    (2, 4, 5, 5, 4, 3, 3, 1, 1, 4),  # depthwise
    (1, 3, 6, 6, 5, 1, 1, 2, 0, 1),  # 1x1 stride 2
    (1, 160, 3, 3, 2, 3, 3, 1, 1, 1),  # K = 1440
    (600, 1, 16, 16, 2, 3, 3, 1, 1, 1),  # N*OH*OW = 153600 > 2^17: weight-grad pre-shift
]


def _geom(rt, cfg):
    n, c, h, w, o, kh, kw, s, p, g = cfg
    geom = ConvGeom()
    rt.mexc_conv_init(C.byref(geom), n, c, h, w, o, kh, kw, s, s, p, p, g)
    return geom


@pytest.mark.parametrize("cfg", CONVS)
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_conv2d(rt, cfg, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    n, c, h, w, o, kh, kw, s, p, g = cfg
    rng = np.random.default_rng(ci * 31 + c)
    geom = _geom(rt, cfg)
    x = MX.of(rng.integers(-127, 128, (n, c, h, w)), -5)
    wt = MX.of(rng.integers(-127, 128, (o, c // g, kh, kw)), -7)
    tid = 16 * (3 + ci)
    for bias in (None, MX.of(rng.integers(-127, 128, (o,)), -9)):
        ref = K.conv2d_forward(x, wt, bias, s, p, g, ctx, tid)
        y = np.zeros(ref.m.shape, np.int8)
        scr = scratch(rt.mexc_conv2d_forward_scratch(C.byref(geom)))
        e = rt.mexc_conv2d_forward(
            C.byref(geom),
            P(i8(x.m)),
            -5,
            P(i8(wt.m)),
            -7,
            P(None if bias is None else i8(bias.m)),
            -9,
            P(y),
            C.byref(c_ctx),
            tid,
            P(scr),
        )
        assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, ref.m.shape), -11)
    ref = K.conv2d_backward_input(dy, wt, x.shape, s, p, g, ctx, tid + 16)
    dx = np.zeros(x.shape, np.int8)
    scr = scratch(rt.mexc_conv2d_backward_input_scratch(C.byref(geom)))
    e = rt.mexc_conv2d_backward_input(
        C.byref(geom), P(i8(dy.m)), -11, P(i8(wt.m)), -7, P(dx), C.byref(c_ctx), tid + 16, P(scr)
    )
    assert e == int(ref.e) and np.array_equal(dx, ref.m)
    ref = K.conv2d_backward_weight(dy, x, wt.shape, s, p, g, ctx, tid + 32)
    dw = np.zeros(wt.shape, np.int32)
    scr = scratch(rt.mexc_conv2d_backward_weight_scratch(C.byref(geom)))
    e = rt.mexc_conv2d_backward_weight(
        C.byref(geom), P(i8(dy.m)), -11, P(i8(x.m)), -5, P(dw), C.byref(c_ctx), tid + 32, P(scr)
    )
    assert e == int(ref.e) and np.array_equal(dw, ref.a)
    db = np.zeros(o, np.int32)
    rt.mexc_bias_backward(n, o, geom.oh * geom.ow, P(i8(dy.m)), P(db))
    assert np.array_equal(db, K.bias_backward(dy, (0, 2, 3)).a)


@pytest.mark.parametrize("nko", [(8, 256, 10), (4, 1568, 10), (3, 7, 5), (300, 20, 4)])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_linear(rt, nko, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    n, k, o = nko
    rng = np.random.default_rng(ci + k)
    x = MX.of(rng.integers(-127, 128, (n, k)), -4)
    w = MX.of(rng.integers(-127, 128, (o, k)), -8)
    b = MX.of(rng.integers(-127, 128, (o,)), -6)
    tid = 16 * 9
    for bias in (b, None):
        ref = K.linear_forward(x, w, bias, ctx, tid)
        y = np.zeros((n, o), np.int8)
        scr = scratch(rt.mexc_fit_scratch(n * k, k))
        e = rt.mexc_linear_forward(
            n,
            k,
            o,
            P(i8(x.m)),
            -4,
            P(i8(w.m)),
            -8,
            P(None if bias is None else i8(bias.m)),
            -6,
            P(y),
            C.byref(c_ctx),
            tid,
            P(scr),
        )
        assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, (n, o)), -10)
    ref = K.linear_backward_input(dy, w, ctx, tid + 16)
    dx = np.zeros((n, k), np.int8)
    scr = scratch(rt.mexc_fit_scratch(n * o, o))
    e = rt.mexc_linear_backward_input(
        n, k, o, P(i8(dy.m)), -10, P(i8(w.m)), -8, P(dx), C.byref(c_ctx), tid + 16, P(scr)
    )
    assert e == int(ref.e) and np.array_equal(dx, ref.m)
    ref = K.linear_backward_weight(dy, x, ctx, tid + 32)
    dw = np.zeros((o, k), np.int32)
    scr = scratch(rt.mexc_fit_scratch(n * o, n))
    e = rt.mexc_linear_backward_weight(
        n, k, o, P(i8(dy.m)), -10, P(i8(x.m)), -4, P(dw), C.byref(c_ctx), tid + 32, P(scr)
    )
    assert e == int(ref.e) and np.array_equal(dw, ref.a)
    db = np.zeros(o, np.int32)
    rt.mexc_bias_backward(n, o, 1, P(i8(dy.m)), P(db))
    assert np.array_equal(db, K.bias_backward(dy, (0,)).a)


@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_linear_preshift(rt, ci):
    """product_cap(K, 8) < 0 (K > 2^17): x (forward) / dy (weight gradient) pre-shift, site 3."""
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci)
    n, k, o = 2, 140000, 2
    x = MX.of(rng.integers(-127, 128, (n, k)), -4)
    w = MX.of(rng.integers(-127, 128, (o, k)), -8)
    ref = K.linear_forward(x, w, None, ctx, 32)
    y = np.zeros((n, o), np.int8)
    scr = scratch(rt.mexc_fit_scratch(n * k, k))
    assert scr.size == (n * k + 3) // 4
    e = rt.mexc_linear_forward(
        n, k, o, P(i8(x.m)), -4, P(i8(w.m)), -8, None, 0, P(y), C.byref(c_ctx), 32, P(scr)
    )
    assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, (k, o)), -9)
    xt = MX.of(rng.integers(-127, 128, (k, 3)), -4)
    ref = K.linear_backward_weight(dy, xt, ctx, 48)
    dw = np.zeros((o, 3), np.int32)
    scr = scratch(rt.mexc_fit_scratch(k * o, k))
    e = rt.mexc_linear_backward_weight(
        k, 3, o, P(i8(dy.m)), -9, P(i8(xt.m)), -4, P(dw), C.byref(c_ctx), 48, P(scr)
    )
    assert e == int(ref.e) and np.array_equal(dw, ref.a)
