"""runtime/mexc_kernels_misc.c + mexc_tables.c vs activation.py, pool.py, loss.py,
elementwise.py and numerics.EXP_TABLE, bit for bit."""

from __future__ import annotations

import ctypes as C
import math

import numpy as np
import pytest

from mexc import kernels as K
from mexc.mx import MX
from mexc.numerics import EXP_TABLE
from tests.mcu.test_runtime_lib import CTXS, P, PoolGeom, ctx_of, i8, i32  # noqa: F401


def test_tables(rt):
    exp = np.ctypeslib.as_array((C.c_int32 * 256).in_dll(rt, "mexc_exp_table"))
    assert np.array_equal(exp, EXP_TABLE.values)
    nll = np.ctypeslib.as_array((C.c_int32 * 256).in_dll(rt, "mexc_nll_micro_table"))
    for i in range(256):
        assert abs(nll[i] - 1e6 * -math.log(max(i, 1) / 256)) <= 0.5


def test_relu(rt):
    rng = np.random.default_rng(0)
    x = MX.of(rng.integers(-127, 128, 500), -3)
    dy = MX.of(rng.integers(-127, 128, 500), -6)
    y = np.zeros(500, np.int8)
    rt.mexc_relu_forward(P(i8(x.m)), P(y), 500)
    assert np.array_equal(y, K.relu_forward(x).m)
    dx = np.zeros(500, np.int8)
    rt.mexc_relu_backward(P(i8(dy.m)), P(i8(x.m)), P(dx), 500)
    assert np.array_equal(dx, K.relu_backward(dy, x).m)


# (N, C, H, W, k, stride, padding)
POOLS = [(2, 3, 8, 8, 2, 2, 0), (1, 2, 7, 7, 3, 2, 1), (2, 2, 6, 6, 3, 1, 1), (1, 1, 5, 4, 2, 1, 0)]


@pytest.mark.parametrize("cfg", POOLS)
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_maxpool(rt, cfg, ci):
    ctx = CTXS[ci]
    n, c, h, w, k, s, p = cfg
    rng = np.random.default_rng(ci + h)
    geom = PoolGeom()
    rt.mexc_pool_init(C.byref(geom), n, c, h, w, k, k, s, s, p, p)
    x = MX.of(rng.integers(-5, 6, (n, c, h, w)), -2)  # small range: ties exercise first-max
    ref, arg = K.maxpool2d_forward(x, k, s, p)
    y = np.zeros(ref.m.shape, np.int8)
    am = np.zeros(ref.m.shape, np.uint8)
    rt.mexc_maxpool2d_forward(C.byref(geom), P(i8(x.m)), P(y), P(am))
    assert np.array_equal(y, ref.m) and np.array_equal(am, arg)
    for amp in (20, 127):  # overlapping windows may exceed qmax -> compaction (site 0)
        dy = MX.of(rng.integers(-amp, amp + 1, ref.m.shape), -7)
        r = K.maxpool2d_backward(dy, arg, x.shape, k, s, p, ctx, 48)
        dx = np.zeros(x.shape, np.int8)
        c_ctx = ctx_of(ctx)
        e = rt.mexc_maxpool2d_backward(
            C.byref(geom), P(i8(dy.m)), -7, P(am), P(dx), C.byref(c_ctx), 48
        )
        assert e == int(r.e) and np.array_equal(dx, r.m)


@pytest.mark.parametrize("ci", range(len(CTXS)))
@pytest.mark.parametrize("e", [-6, -4, -2, 0, 2])
def test_softmax_ce(rt, ci, e):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci * 7 + e + 10)
    n, k = 8, 10
    logits = MX.of(rng.integers(-127, 128, (n, k)), e)
    labels = rng.integers(0, k, n)
    for valid in (8, 5, 0):
        p_ref, loss = K.softmax_ce_forward(logits, labels, valid, ctx, 16)
        probs = np.zeros((n, k), np.int16)
        lm = rt.mexc_softmax_ce_forward(
            n, k, P(i8(logits.m)), e, P(i32(labels)), valid, P(probs), C.byref(c_ctx), 16
        )
        assert np.array_equal(probs, p_ref)
        assert abs(lm - 1000 * loss) <= 0.52  # rounded to milli-nats
        g = K.softmax_ce_backward(p_ref, labels, valid, ctx, 32)
        dx = np.zeros((n, k), np.int8)
        eg = rt.mexc_softmax_ce_backward(
            n, k, P(probs), P(i32(labels)), valid, P(dx), C.byref(c_ctx), 32
        )
        assert eg == int(g.e) and np.array_equal(dx, g.m)


@pytest.mark.parametrize("ci", range(len(CTXS)))
@pytest.mark.parametrize("t", [1, 2, 3, 4, 13])
def test_grad_sum_add(rt, ci, t):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci * 13 + t)
    shape = (2, 3, 5, 5)
    terms = [MX.of(rng.integers(-127, 128, shape), int(rng.integers(-12, -2))) for _ in range(t)]
    ref = K.grad_sum(terms, ctx, 64)
    xs = [i8(m.m) for m in terms]
    ptrs = (C.c_void_p * t)(*[P(x) for x in xs])
    es = i32([int(m.e) for m in terms])
    out = np.zeros(shape, np.int8)
    e = rt.mexc_grad_sum(t, ptrs, P(es), out.size, P(out), C.byref(c_ctx), 64)
    assert e == int(ref.e) and np.array_equal(out, ref.m)
    if t == 2:
        ref = K.add_forward(terms[0], terms[1], ctx, 80)
        e = rt.mexc_add_forward(
            P(xs[0]),
            int(terms[0].e),
            P(xs[1]),
            int(terms[1].e),
            out.size,
            P(out),
            C.byref(c_ctx),
            80,
        )
        assert e == int(ref.e) and np.array_equal(out, ref.m)
