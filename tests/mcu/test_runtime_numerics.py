"""runtime/mexc_numerics.c + mexc_update.c vs mexc/numerics.py, bit for bit."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from mexc import numerics as nx
from tests.mcu.test_runtime_lib import Fixed, P, Recip, UpdateCfg, i8, i32  # noqa: F401

EDGE = np.array(
    [
        0,
        1,
        -1,
        2,
        -2,
        127,
        -127,
        128,
        -128,
        255,
        -255,
        2**15,
        -(2**15),
        2**30,
        -(2**30),
        2**31 - 1,
        -(2**31),
        2**31 - 2,
        -(2**31) + 1,
    ],
    np.int64,
)
ROUND = [(1, "stochastic"), (0, "nearest")]


def test_prng(rt):
    rng = np.random.default_rng(0)
    xs = np.concatenate([[0, 1, 0xFFFFFFFF, 0x80000000], rng.integers(0, 2**32, 200)])
    for v in xs:
        assert rt.mexc_mix32(int(v)) == int(nx.mix32(int(v)))
    for seed, step, tid in [(0, 0, 0), (1, 2, 3), (0xDEADBEEF, 99, 16 * 7 + 5), (2**32 - 1, 1, 8)]:
        key = nx.stream_key(seed, step, tid)
        assert rt.mexc_stream_key(seed, step, tid) == key
        ref = nx.random_bits(key, np.arange(100, dtype=np.uint32))
        assert [rt.mexc_rand(key, i) for i in range(100)] == [int(v) for v in ref]


@pytest.mark.parametrize("stoch,rnd", ROUND)
def test_shift_right(rt, stoch, rnd):
    rng = np.random.default_rng(1)
    x = np.concatenate([EDGE, rng.integers(-(2**31), 2**31, 300), rng.integers(-300, 300, 100)])
    key = nx.stream_key(7, 3, 21)
    for s in [0, 1, 2, 5, 7, 15, 16, 30, 31, 32, 33, 40, 100]:
        ref = nx.shift_right(x, s, rnd, key)
        got = [rt.mexc_shift_right(int(v), s, stoch, key, i) for i, v in enumerate(x)]
        assert got == [int(v) for v in ref], s
        if abs(s) < 31:  # shift_signed with a left shift that fits
            small = np.clip(x, -(2 ** (30 - s)), 2 ** (30 - s))
            ref = nx.shift_signed(small, -s, rnd, key)
            got = [rt.mexc_shift_signed(int(v), -s, stoch, key, i) for i, v in enumerate(small)]
            assert got == [int(v) for v in ref]


def test_shift_left_saturating(rt):
    for x in [0, 1, -1, 127, -127, 3000, -(2**22), 2**22 - 1]:
        for s in [0, 1, 8, 20, 29, 30, 31, 40, 45, 54, 60]:
            for lim in (29, 30):
                ref = int(nx.shift_left_saturating(np.int64(x), s, lim))
                assert rt.mexc_shift_left_sat(x, s, lim) == ref, (x, s, lim)


def test_compaction_shift(rt):
    for bits in range(2, 9):
        for m in [0, 1, 2, 3, 63, 64, 126, 127, 128, 255, 2**20 + 3, 2**31 - 1, 2**31]:
            assert rt.mexc_compaction_shift(m, bits) == int(nx.compaction_shift(m, bits))


@pytest.mark.parametrize("stoch,rnd", ROUND)
@pytest.mark.parametrize("bits", [8, 5, 2])
def test_compact(rt, stoch, rnd, bits):
    rng = np.random.default_rng(bits)
    key = nx.stream_key(1, 2, 3)
    for scale in [100, 2**16, 2**31 - 1]:
        acc = rng.integers(-scale, scale, (6, 37))
        acc[0, 0] = -(2**31) if scale == 2**31 - 1 else acc[0, 0]
        m_ref, e_ref = nx.compact(acc, 5, bits, rnd, key)
        out = np.zeros(acc.size, np.int8)
        e = rt.mexc_compact(P(i32(acc)), P(out), acc.size, 5, bits, stoch, key)
        assert e == int(e_ref) and np.array_equal(out, m_ref.ravel())
        # per group along axis 0
        e_in = np.array([3, -4, 0, 9, -20, 1])
        acc[2] = 0
        m_ref, e_ref = nx.compact(acc, e_in, bits, rnd, key, grouped=True)
        a32, e_out = i32(acc), np.zeros(6, np.int32)
        rt.mexc_compact_grouped(P(a32), P(out), 6, 37, P(i32(e_in)), P(e_out), bits, stoch, key)
        assert np.array_equal(out, m_ref.ravel()) and np.array_equal(e_out, e_ref)
        # compact_to_bits
        x_ref, e2 = nx.compact_to_bits(acc.ravel(), 0, 15, rnd, key)
        got = np.zeros(acc.size, np.int32)
        s = rt.mexc_compact_to_bits(P(a32), P(got), acc.size, 15, stoch, key)
        assert s == int(e2) and np.array_equal(got, x_ref)


@pytest.mark.parametrize("stoch,rnd", ROUND)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13])
def test_aligned_sum(rt, stoch, rnd, m):
    rng = np.random.default_rng(m)
    n = 50
    for trial in range(6):
        b = rng.integers(3, 24, m)
        e = rng.integers(-40, 40, m)
        if trial == 0:
            e[:] = 0  # equal exponents, power-of-two m hits the c = bit_length rule
            b[:] = 30 - m.bit_length() + 1
        xs = [rng.integers(-(2 ** int(bb)) + 1, 2 ** int(bb), n) for bb in b]
        for x, bb in zip(xs, b):
            x[0] = 2 ** int(bb) - 1
        keys = [nx.stream_key(9, trial, i) for i in range(m)]
        ref, tgt = nx.aligned_sum([(x, int(ee), int(bb)) for x, ee, bb in zip(xs, e, b)], rnd, keys)
        x32 = [i32(x) for x in xs]
        ptrs = (C.c_void_p * m)(*[P(x) for x in x32])
        out = np.zeros(n, np.int32)
        kk = np.array(keys, np.uint32)
        t = rt.mexc_aligned_sum(m, ptrs, P(i32(e)), P(i32(b)), P(out), n, stoch, P(kk))
        assert t == int(tgt) and np.array_equal(out, ref)


def test_div_isqrt_idiv(rt):
    rt.mexc_recip_of.restype = Recip
    rt.mexc_recip_of.argtypes = [C.c_uint32]
    xs = np.arange(-(2**15), 2**15 + 1, 97)
    xs = np.concatenate([xs, [-(2**15), 2**15, 0, 1, -1]])
    for d in [1, 2, 3, 4, 5, 6, 7, 9, 12, 25, 49, 196, 1000, 65535, 2**20 + 1]:
        r = nx.Reciprocal.of(d)
        c = rt.mexc_recip_of(d)
        assert (c.pow2, c.odd, c.mult, c.shift) == (r.pow2, r.odd, r.mult, r.shift)
        q_ref, _ = nx.div_const(xs, 0, r)
        assert [rt.mexc_div_const(int(v), C.byref(c)) for v in xs] == [int(v) for v in q_ref]
    rng = np.random.default_rng(5)
    n32 = np.concatenate([[0, 1, 2, 3, 4, 2**30, 2**32 - 1, 2**31], rng.integers(0, 2**32, 300)])
    for v in n32:
        assert rt.mexc_isqrt32(int(v)) == int(nx.isqrt(np.int64(v)))
    n64 = np.concatenate([[2**62 - 1, 2**32, 2**40 + 7], rng.integers(0, 2**62, 300)])
    for v in n64:
        assert rt.mexc_isqrt64(int(v)) == int(nx.isqrt(np.int64(v)))
    a = np.concatenate([EDGE[EDGE > -(2**31)], rng.integers(-(2**31) + 1, 2**31, 300)])
    for b in [1, 2, 3, 7, 10, 255, 256, 2**15, 2**31 - 1]:
        assert [rt.mexc_idiv_round(int(v), b) for v in a] == list(nx.idiv_round(a, b))
        assert [rt.mexc_idiv_floor(int(v), b) for v in a] == list(nx.idiv_floor(a, b))


def _cfg(bits, rnd, lr, mom, wd):
    f = [nx.FixedScalar.of(v) for v in (lr, mom, wd)]
    py = nx.UpdateConfig(bits, f[0], f[1], f[2], rnd)
    c = UpdateCfg(bits, 1 if rnd == "stochastic" else 0, *[Fixed(v.num, v.shift) for v in f])
    return py, c


@pytest.mark.parametrize("stoch,rnd", ROUND)
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("hyper", [(0.05, 0.9, 1e-4), (0.1, 0.0, 0.0), (2.0, 0.5, 0.01)])
def test_sgd_momentum_update(rt, stoch, rnd, grouped, hyper):
    rng = np.random.default_rng(11)
    for bits in (8, 6):
        py, c = _cfg(bits, rnd, *hyper)
        q = nx.qmax(bits)
        for trial in range(5):
            shape = (6, 3, 3, 3)
            g = 6 if grouped else 1
            w = rng.integers(-q, q + 1, shape)
            grad = rng.integers(-(2 ** (10 + 5 * trial)), 2 ** (10 + 5 * trial), shape)
            v = rng.integers(-q, q + 1, shape)
            v_exp = rng.integers(-14, -4, g)
            w_exp, grad_exp = int(rng.integers(-9, -5)), int(rng.integers(-20, -10))
            if trial >= 3:  # an all-zero weight takes the update's exponent
                w[:] = 0
                v[:] = 0
            if trial == 4:  # ... of the groups whose update is nonzero
                grad[::2] = 0
            tid = 16 * int(rng.integers(0, 50))
            keys = nx.update_keys(123, trial, tid)
            ck = np.zeros(9, np.uint32)
            rt.mexc_update_keys(123, trial, tid, P(ck))
            assert list(ck) == keys
            ref = nx.sgd_momentum_update(w, w_exp, grad, grad_exp, v, v_exp.copy(), py, keys)
            wc, gc, vc, vec = i8(w), i32(grad), i8(v), i32(v_exp)
            we = C.c_int32(w_exp)
            scr = np.zeros(2 * g, np.int32)
            rt.mexc_sgd_momentum_update(
                P(wc),
                C.byref(we),
                P(gc),
                grad_exp,
                P(vc),
                P(vec),
                g,
                w.size // g,
                C.byref(c),
                P(ck),
                P(scr),
            )
            assert np.array_equal(wc, ref[0]) and we.value == ref[1]
            assert np.array_equal(vc, ref[2]) and np.array_equal(vec, ref[3])


def test_reactive_rescale(rt):
    rng = np.random.default_rng(3)
    for stoch, rnd in ROUND:
        for amp in [0, 1, 30, 63, 64, 127, 128, 5000, 2**30]:
            acc = rng.integers(-amp, amp + 1, 40)
            ref_w, ref_e = nx.reactive_rescale(acc, -7, 8, rnd, 77)
            out = np.zeros(40, np.int8)
            e = rt.mexc_reactive_rescale(P(i32(acc)), P(out), 40, -7, 8, stoch, 77)
            assert e == ref_e and np.array_equal(out, ref_w)


def test_state_checksum(rt):
    rng = np.random.default_rng(4)
    state = {
        "b.weight": (rng.integers(-127, 128, (4, 3)), np.array(-7)),
        "a.velocity": (rng.integers(-127, 128, (5,)), rng.integers(-(2**31), 2**31, 5)),
    }
    h = nx.FNV64_OFFSET
    for name in sorted(state):
        m, e = state[name]
        m8, e32 = i8(m).ravel(), np.atleast_1d(i32(e))
        h = rt.mexc_fnv1a64(P(m8), m8.size, h)
        h = rt.mexc_fnv1a64_i32(P(e32), e32.size, h)
    assert f"{h:016x}" == nx.state_checksum(state)
