"""runtime/mexc_kernels_norm.c vs mexc/kernels/norm.py (train, backward, running update, eval)."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from mexc import kernels as K
from mexc.kernels.norm import _rstd
from mexc.mx import MX
from mexc.numerics import FixedScalar
from tests.mcu.test_runtime_lib import (  # noqa: F401
    CTXS,
    BnSaved,
    Fixed,
    P,
    ctx_of,
    i8,
    i32,
    scratch,
)

SHAPES = [(8, 8, 8, 8), (4, 16, 4, 4), (8, 10), (2, 3, 1, 1), (3, 5, 7, 2)]
EPS = FixedScalar.of(1e-5)
MOM = FixedScalar.of(0.1)


def _saved(n, c, s):
    arrs = {"xhat": np.zeros(n * c * s, np.int8)}
    for k in ("rstd", "rstd_e", "mean", "var", "var_u", "var_e"):
        arrs[k] = np.zeros(c, np.int32)
    sv = BnSaved()
    for k, a in arrs.items():
        setattr(sv, k, a.ctypes.data)
    return sv, arrs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_batchnorm(rt, shape, ci):
    ctx = CTXS[ci]
    c_ctx = ctx_of(ctx)
    rng = np.random.default_rng(ci * 5 + len(shape) + shape[1])
    n, c = shape[:2]
    s = int(np.prod(shape[2:], dtype=np.int64))
    amp = 127 if ci % 2 else 9  # small inputs give large rstd / left-shifted eps
    x = MX.of(rng.integers(-amp, amp + 1, shape), -4)
    gamma = MX.of(rng.integers(-127, 128, c), -7)
    beta = MX.of(rng.integers(-127, 128, c), -8)
    tid = 16 * 5
    y_ref, sref = K.batchnorm_forward_train(x, gamma, beta, EPS, ctx, tid)
    sv, arrs = _saved(n, c, s)
    y = np.zeros(shape, np.int8)
    scr = scratch(6 * c)
    ey = rt.mexc_batchnorm_forward_train(
        n,
        c,
        s,
        P(i8(x.m)),
        -4,
        P(i8(gamma.m)),
        -7,
        P(i8(beta.m)),
        -8,
        Fixed(EPS.num, EPS.shift),
        P(y),
        C.byref(sv),
        C.byref(c_ctx),
        tid,
        P(scr),
    )
    assert np.array_equal(arrs["mean"], sref.mean.a) and sv.mean_e == int(sref.mean.e)
    assert np.array_equal(arrs["var"], sref.var.a) and np.array_equal(arrs["var_e"], sref.var.e)
    assert np.array_equal(arrs["var_u"], sref.var_unbiased.a)
    assert np.array_equal(arrs["rstd"], sref.rstd)
    assert np.array_equal(arrs["rstd_e"], sref.rstd_e)
    assert np.array_equal(arrs["xhat"], sref.xhat.m.ravel()) and sv.xhat_e == int(sref.xhat.e)
    assert ey == int(y_ref.e) and np.array_equal(y, y_ref.m)
    assert sv.count == sref.count

    # backward
    dy = MX.of(rng.integers(-127, 128, shape), -9)
    dx_ref, dg_ref, db_ref = K.batchnorm_backward(dy, sref, ctx, tid + 16)
    dx = np.zeros(shape, np.int8)
    dg, db = np.zeros(c, np.int32), np.zeros(c, np.int32)
    e_dx, e_dg = C.c_int32(), C.c_int32()
    scr = scratch(6 * c + rt.mexc_fit_scratch(n * c * s, n * s))
    rt.mexc_batchnorm_backward(
        n,
        c,
        s,
        P(i8(dy.m)),
        -9,
        C.byref(sv),
        P(i8(gamma.m)),
        -7,
        P(dx),
        C.byref(e_dx),
        P(dg),
        C.byref(e_dg),
        P(db),
        C.byref(c_ctx),
        tid + 16,
        P(scr),
    )
    assert np.array_equal(db, db_ref.a)
    assert np.array_equal(dg, dg_ref.a) and e_dg.value == int(dg_ref.e)
    assert e_dx.value == int(dx_ref.e) and np.array_equal(dx, dx_ref.m)

    # running statistics, per-channel and per-tensor exponents
    for grouped in (True, False):
        ne = c if grouped else 1
        rm = MX.of(rng.integers(-127, 128, c), rng.integers(-10, -3, ne) if grouped else -6)
        rv = MX.of(rng.integers(0, 128, c), rng.integers(-10, -3, ne) if grouped else -5)
        rm_ref, rv_ref = K.batchnorm_update_running(
            rm, rv, sref.mean, sref.var_unbiased, MOM, ctx, tid + 32
        )
        rmc, rvc = i8(rm.m), i8(rv.m)
        rme, rve = np.atleast_1d(i32(rm.e)).copy(), np.atleast_1d(i32(rv.e)).copy()
        rt.mexc_batchnorm_update_running(
            c,
            P(rmc),
            P(rme),
            int(grouped),
            P(rvc),
            P(rve),
            int(grouped),
            C.byref(sv),
            Fixed(MOM.num, MOM.shift),
            C.byref(c_ctx),
            tid + 32,
            P(scratch(6 * c)),
        )
        assert np.array_equal(rmc, rm_ref.m) and np.array_equal(rme, np.atleast_1d(rm_ref.e))
        assert np.array_equal(rvc, rv_ref.m) and np.array_equal(rve, np.atleast_1d(rv_ref.e))

        # eval with these running statistics
        ye_ref = K.batchnorm_forward_eval(x, gamma, beta, rm_ref, rv_ref, ctx, tid + 48, eps=EPS)
        ye = np.zeros(shape, np.int8)
        ee = rt.mexc_batchnorm_forward_eval(
            n,
            c,
            s,
            P(i8(x.m)),
            -4,
            P(i8(gamma.m)),
            -7,
            P(i8(beta.m)),
            -8,
            P(rmc),
            P(rme),
            int(rm_ref.grouped),
            P(rvc),
            P(rve),
            int(rv_ref.grouped),
            Fixed(EPS.num, EPS.shift),
            P(ye),
            C.byref(c_ctx),
            tid + 48,
            P(scratch(6 * c)),
        )
        assert ee == int(ye_ref.e) and np.array_equal(ye, ye_ref.m)


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 0.0])
def test_rstd_of_every_variance_scale(rt, eps: float) -> None:
    """mexc_rstd against norm._rstd where eps dominates the variance (the summing exponent
    rises above ev), where the two are comparable and where eps vanishes below a unit."""
    fixed = FixedScalar.of(eps)
    var = np.array([0, 1, 7, 1 << 12, (1 << 29) + 12345, 1 << 30], np.int64)
    for ev in (-300, -120, -47, -46, -45, -30, -17, 0, 30):
        want, want_e = _rstd(var, np.full(var.shape, ev, np.int64), fixed)
        for v, w, we in zip(var, want, want_e, strict=True):
            e = C.c_int32(0)
            got = rt.mexc_rstd(int(v), ev, Fixed(fixed.num, fixed.shift), C.byref(e))
            assert (got, e.value) == (int(w), int(we)), (int(v), ev)
