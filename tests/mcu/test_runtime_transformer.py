"""runtime/mexc_kernels_transformer.c (+ the token mean of mexc_kernels_extra.c) vs
mexc/kernels/transformer.py and the executor's data movement rules, bit for bit."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from mexc import kernels as K
from mexc.mx import MX
from mexc.numerics import GELU_GRAD_TABLE, GELU_PHI_TABLE, FixedScalar
from tests.mcu.test_runtime_lib import CTXS, Fixed, P, _sig, ctx_of, i8, scratch


class LnSaved(C.Structure):
    _fields_ = [
        ("xhat", C.c_void_p),
        ("xhat_e", C.c_int32),
        ("rstd", C.c_void_p),
        ("rstd_e", C.c_void_p),
        ("rows", C.c_uint32),
        ("d", C.c_uint32),
    ]


SIGS = {
    "mexc_layernorm_forward": "i uupipipiFpppupuu",
    "mexc_layernorm_backward": "v uupippippppppupuu",
    "mexc_table_product": "i pipipiiiuppu",
    "mexc_softmax_forward": "i uupippu",
    "mexc_softmax_backward": "i uupipippup",
    "mexc_softmax_backward_scratch": "u uu",
    "mexc_matmul_forward": "i uuuupipippup",
    "mexc_matmul_forward_scratch": "u uuu",
    "mexc_matmul_backward": "v uuuupipipipppppup",
    "mexc_matmul_backward_scratch": "u uuuu",
    "mexc_scale_forward": "i piuFppu",
    "mexc_add_broadcast_forward": "i pipiuuuppu",
    "mexc_mean_axis_forward": "i uuupippu",
    "mexc_mean_axis_backward": "i uuupippu",
    "mexc_transpose": "v ppupp",
    "mexc_slice_forward": "v uuuuupp",
    "mexc_slice_backward": "v uuuuupp",
}


@pytest.fixture(scope="module")
def lib(rt):
    for name, sig in SIGS.items():
        _sig(rt, name, sig)
    return rt


def _out(shape) -> np.ndarray:
    return np.zeros(shape, np.int8)


def _e() -> C.c_int32:
    return C.c_int32(0)


# (shape, x amplitude, eps, GroupNorm's groups or 0 for LayerNorm); D = 1500: the D-wide g
# sums are pre-shifted (site 5); GroupNorm on (N, C, H, W) and on (N, C)
LN = [
    ((2, 5, 16), 127, 1e-5, 0),
    ((3, 64), 60, 1e-5, 0),
    ((4, 8), 3, 0.5, 0),
    ((2, 1500), 127, 1e-5, 0),
    ((2, 6, 10), 0, 1e-5, 0),
    ((2, 6, 3, 4), 127, 1e-5, 3),
    ((3, 8, 5, 5), 40, 1e-5, 1),
    ((4, 12), 90, 1e-5, 4),
]


@pytest.mark.parametrize("cfg", range(len(LN)))
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_layernorm(lib, cfg, ci):
    shape, amp, eps, gn = LN[cfg]
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(cfg * 10 + ci)
    groups, per = (gn, int(np.prod(shape[2:]))) if gn else (1, 1)
    rows = shape[0] * groups if gn else int(np.prod(shape[:-1]))
    d = int(np.prod(shape)) // rows
    params = shape[1] if gn else d
    x = MX.of(rng.integers(-amp, amp + 1, shape), -5)
    gamma = MX.of(rng.integers(-127, 128, params), -7)
    beta = MX.of(rng.integers(-127, 128, params), -8)
    ref, saved = K.layernorm_forward(x, gamma, beta, eps, ctx, 32, groups, per)
    y, xhat = _out(shape), _out(shape)
    rstd, rstd_e = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    sv = LnSaved(xhat.ctypes.data, 0, rstd.ctypes.data, rstd_e.ctypes.data, 0, 0)
    fe = FixedScalar.of(eps)
    e = lib.mexc_layernorm_forward(
        rows,
        d,
        P(i8(x.m)),
        -5,
        P(i8(gamma.m)),
        -7,
        P(i8(beta.m)),
        -8,
        Fixed(fe.num, fe.shift),
        P(y),
        C.byref(sv),
        C.byref(c_ctx),
        32,
        P(scratch(5 * rows)),
        groups,
        per,
    )
    assert e == int(ref.e) and np.array_equal(y, ref.m)
    assert sv.xhat_e == int(saved.xhat.e) and np.array_equal(xhat, saved.xhat.m)
    assert np.array_equal(rstd, saved.rstd) and np.array_equal(rstd_e, saved.rstd_e)
    dy = MX.of(rng.integers(-127, 128, shape), -9)
    dx_ref, dg_ref, db_ref = K.layernorm_backward(dy, saved, ctx, 64)
    dx, dg, db = _out(shape), np.zeros(params, np.int32), np.zeros(params, np.int32)
    edx, edg = _e(), _e()
    words = 5 * rows + (rows * d + 3) // 4
    lib.mexc_layernorm_backward(
        rows,
        d,
        P(i8(dy.m)),
        -9,
        C.byref(sv),
        P(i8(gamma.m)),
        -7,
        P(dx),
        C.byref(edx),
        P(dg),
        C.byref(edg),
        P(db),
        C.byref(c_ctx),
        64,
        P(scratch(words)),
        groups,
        per,
    )
    assert edx.value == int(dx_ref.e) and np.array_equal(dx, dx_ref.m)
    assert edg.value == int(dg_ref.e) and np.array_equal(dg, dg_ref.a)
    assert np.array_equal(db, db_ref.a)


@pytest.mark.parametrize("e", [-8, -5, -4, -3, -1, 0, 1, 2, 3, 6])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_gelu(lib, e, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci + 50 + e)
    x = MX.of(rng.integers(-127, 128, (6, 50)), e)
    # GELU is x times Phi(x): the C backend emits its tables and calls the table product
    tables = (GELU_PHI_TABLE, GELU_GRAD_TABLE)
    phi, grad = (np.ascontiguousarray(t.values, np.int32) for t in tables)
    ref = K.gelu_forward(x, ctx, 16)
    y = _out(x.shape)
    xm = i8(x.m)
    n, ptr = x.m.size, GELU_PHI_TABLE
    got = lib.mexc_table_product(
        P(xm), e, P(xm), e, P(phi), ptr.in_exp, ptr.out_exp, 0, n, P(y), C.byref(c_ctx), 16
    )
    assert got == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, x.shape), -6)
    r = K.gelu_backward(dy, x, ctx, 48)
    dx = _out(x.shape)
    got = lib.mexc_table_product(
        P(i8(dy.m)),
        -6,
        P(xm),
        e,
        P(grad),
        GELU_GRAD_TABLE.in_exp,
        GELU_GRAD_TABLE.out_exp,
        0,
        n,
        P(dx),
        C.byref(c_ctx),
        48,
    )
    assert got == int(r.e) and np.array_equal(dx, r.m)


@pytest.mark.parametrize("shape,e", [((2, 4, 16, 16), -3), ((5, 10), 0), ((3, 7), -7), ((4, 1), 2)])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_softmax(lib, shape, e, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci + len(shape))
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    x = MX.of(rng.integers(-127, 128, shape), e)
    ref = K.softmax_forward(x, ctx, 16)
    p = _out(shape)
    got = lib.mexc_softmax_forward(rows, k, P(i8(x.m)), e, P(p), C.byref(c_ctx), 16)
    assert got == int(ref.e) and np.array_equal(p, ref.m)
    dy = MX.of(rng.integers(-127, 128, shape), -4)
    r = K.softmax_backward(dy, ref, ctx, 32)
    dx = _out(shape)
    words = lib.mexc_softmax_backward_scratch(rows, k)
    got = lib.mexc_softmax_backward(
        rows, k, P(i8(dy.m)), -4, P(p), int(ref.e), P(dx), C.byref(c_ctx), 32, P(scratch(words))
    )
    assert got == int(r.e) and np.array_equal(dx, r.m)


# (batch dims, M, K, N); M = 2^17 + 1: a^T is pre-shifted for db (site 3)
MM = [((2, 4), 16, 16, 16), ((3,), 5, 7, 2), ((), 4, 9, 3), ((1,), 131073, 2, 2)]


@pytest.mark.parametrize("cfg", range(len(MM)))
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_matmul(lib, cfg, ci):
    lead, m, k, n = MM[cfg]
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci + 3 * cfg)
    bt = int(np.prod(lead))
    a = MX.of(rng.integers(-127, 128, (*lead, m, k)), -6)
    b = MX.of(rng.integers(-127, 128, (*lead, k, n)), -4)
    ref = K.matmul_forward(a, b, ctx, 16)
    y = _out(ref.m.shape)
    words = lib.mexc_matmul_forward_scratch(bt, m, k)
    got = lib.mexc_matmul_forward(
        bt, m, k, n, P(i8(a.m)), -6, P(i8(b.m)), -4, P(y), C.byref(c_ctx), 16, P(scratch(words))
    )
    assert got == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, ref.m.shape), -8)
    da_ref, db_ref = K.matmul_backward(dy, a, b, ctx, 32)
    da, db, eda, edb = _out(a.shape), _out(b.shape), _e(), _e()
    words = lib.mexc_matmul_backward_scratch(bt, m, k, n)
    lib.mexc_matmul_backward(
        bt,
        m,
        k,
        n,
        P(i8(dy.m)),
        -8,
        P(i8(a.m)),
        -6,
        P(i8(b.m)),
        -4,
        P(da),
        C.byref(eda),
        P(db),
        C.byref(edb),
        C.byref(c_ctx),
        32,
        P(scratch(words)),
    )
    assert eda.value == int(da_ref.e) and np.array_equal(da, da_ref.m)
    assert edb.value == int(db_ref.e) and np.array_equal(db, db_ref.m)


@pytest.mark.parametrize("value", [0.25, 0.17677669529663687, 3.0, 1.0])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_scale(lib, value, ci):
    ctx = CTXS[ci]
    rng = np.random.default_rng(ci)
    x = MX.of(rng.integers(-127, 128, (3, 40)), -2)
    s = FixedScalar.of(value)
    ref = K.scale_forward(x, s, ctx, 16)
    y = _out(x.shape)
    got = lib.mexc_scale_forward(
        P(i8(x.m)), -2, x.m.size, Fixed(s.num, s.shift), P(y), C.byref(ctx_of(ctx)), 16
    )
    assert got == int(ref.e) and np.array_equal(y, ref.m)


@pytest.mark.parametrize("ex,ep", [(-5, -9), (-9, -5), (-6, -6)])
@pytest.mark.parametrize("ci", range(len(CTXS)))
@pytest.mark.parametrize(
    ("view", "omi"), [((1, 16, 8), (3, 128, 1)), ((1, 16, 1), (3, 16, 8)), ((1, 1, 1), (384, 1, 1))]
)
def test_add_broadcast(lib, ex, ep, ci, view, omi):
    """A positional embedding (1, 16, 8), a bias per channel (1, 16, 1) and one for all."""
    ctx = CTXS[ci]
    rng = np.random.default_rng(ci - ex)
    x = MX.of(rng.integers(-127, 128, (3, 16, 8)), ex)
    p = MX.of(rng.integers(-127, 128, (int(np.prod(view)),)), ep)
    ref = K.add_broadcast_forward(x, p, ctx, 16, view)
    y = _out(x.shape)
    got = lib.mexc_add_broadcast_forward(
        P(i8(x.m)), ex, P(i8(p.m)), ep, *omi, P(y), C.byref(ctx_of(ctx)), 16
    )
    assert got == int(ref.e) and np.array_equal(y, ref.m)


@pytest.mark.parametrize("shape", [(2, 16, 64), (3, 5, 7), (2, 600, 3)])
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_mean_tokens(lib, shape, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    b, t, d = shape
    rng = np.random.default_rng(ci + t)
    x = MX.of(rng.integers(-127, 128, shape), -3)
    ref = K.mean_tokens_forward(x, ctx, 16)
    y = _out((b, d))
    got = lib.mexc_mean_axis_forward(b, t, d, P(i8(x.m)), -3, P(y), C.byref(c_ctx), 16)
    assert got == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, (b, d)), -7)
    r = K.mean_tokens_backward(dy, t, ctx, 32)
    dx = _out(shape)
    got = lib.mexc_mean_axis_backward(b, t, d, P(i8(dy.m)), -7, P(dx), C.byref(c_ctx), 32)
    assert got == int(r.e) and np.array_equal(dx, r.m)


@pytest.mark.parametrize(
    "shape,perm",
    [
        ((2, 16, 4, 16), (0, 2, 1, 3)),
        ((2, 4, 16, 16), (0, 1, 3, 2)),
        ((2, 64, 16), (0, 2, 1)),
        ((3, 4, 5), (2, 0, 1)),
        ((7,), (0,)),
        ((2, 3, 4, 5, 6), (4, 2, 0, 3, 1)),
    ],
)
def test_transpose(lib, shape, perm):
    x = np.random.default_rng(len(shape)).integers(-127, 128, shape).astype(np.int8)
    y = _out(x.size)
    lib.mexc_transpose(
        P(x), P(y), len(shape), P(np.array(shape, np.uint32)), P(np.array(perm, np.uint32))
    )
    assert np.array_equal(y, np.ascontiguousarray(x.transpose(perm)).reshape(-1))


@pytest.mark.parametrize(
    "shape,dim,start,stop",
    [((2, 17, 8), 1, 1, 17), ((2, 17, 8), 1, 0, 1), ((4, 6), 0, 1, 3), ((3, 5), 1, 2, 5)],
)
def test_slice(lib, shape, dim, start, stop):
    x = np.random.default_rng(dim).integers(-127, 128, shape).astype(np.int8)
    idx = [slice(None)] * len(shape)
    idx[dim] = slice(start, stop)
    ref = np.ascontiguousarray(x[tuple(idx)])
    outer, inner = int(np.prod(shape[:dim])), int(np.prod(shape[dim + 1 :]))
    geom = (outer, shape[dim], start, stop - start, inner)
    y = _out(ref.shape)
    lib.mexc_slice_forward(*geom, P(x), P(y))
    assert np.array_equal(y, ref)
    dx = np.full(shape, 99, np.int8)
    lib.mexc_slice_backward(*geom, P(ref), P(dx))
    back = np.zeros(shape, np.int8)
    back[tuple(idx)] = ref
    assert np.array_equal(dx, back)
