"""The blocked int32 fast paths of norm/pool/activation equal the checked reference paths bit for
bit (overflow debugging switches the fast paths off)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mexc import kernels as K
from mexc.kernels._common import round_shift32, round_shift_blocked
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import overflow_debug


def _eq(a, b) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a2, b2 = np.asarray(a), np.asarray(b)
        assert a2.dtype == b2.dtype and a2.shape == b2.shape and np.array_equal(a2, b2)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _eq(x, y)
    elif isinstance(a, MX):
        _eq(a.m, b.m)
        _eq(a.e, b.e)
    elif isinstance(a, Acc):
        _eq(a.a, b.a)
        _eq(a.e, b.e)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _eq(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def _both(fn, *args):
    fast = fn(*args)
    with overflow_debug():
        ref = fn(*args)
    _eq(fast, ref)
    return fast


def _mx(rng, shape, e=-4, lo=-127, hi=128):
    return MX(rng.integers(lo, hi, shape).astype(np.int8), np.asarray(e, np.int64))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("shape", [(64, 8, 12, 12), (40, 6), (3, 5, 7, 9)])
def test_batchnorm_train_and_backward(rounding, shape):
    rng = np.random.default_rng(sum(shape))
    ctx = RoundCtx(seed=3, step=2, bits=8, rounding=rounding)
    c = shape[1]
    x = _mx(rng, shape, -5, -60, 100)
    gamma, beta = _mx(rng, (c,), -6), _mx(rng, (c,), 0, -3, 4)
    y, saved = _both(K.batchnorm_forward_train, x, gamma, beta, 1e-5, ctx, 64)
    dy = _mx(rng, shape, -17)
    _both(K.batchnorm_backward, dy, saved, ctx, 96)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("ex", [-20, 16])
def test_batchnorm_zero_variance_channel(rounding, ex):
    """A constant channel beside channels of large variance: its 1/sigma (from eps) puts its
    xhat and dx groups above the common exponent; both paths give it zeros, as the lowered
    kernels do (docs/numerics.md section 5: compaction to a common exponent)."""
    shape = (64, 3, 8, 8)
    rng = np.random.default_rng(1)
    ctx = RoundCtx(seed=5, step=1, bits=4, rounding=rounding)
    c = shape[1]
    x = _mx(rng, shape, ex, -60, 100)
    x.m[:, 1] = 0
    gamma, beta = _mx(rng, (c,), -6, 1, 128), _mx(rng, (c,), 0, -3, 4)
    y, saved = _both(K.batchnorm_forward_train, x, gamma, beta, 1e-5, ctx, 64)
    assert not np.any(saved.xhat.m[:, 1])
    dy = _mx(rng, shape, -17)
    dy.m[:, 1] = 0
    dx, _, _ = _both(K.batchnorm_backward, dy, saved, ctx, 96)
    assert not np.any(dx.m[:, 1])


@pytest.mark.parametrize("shape", [(4, 3, 8, 8), (2, 5, 7, 9), (3, 2, 2, 2)])
def test_maxpool_2x2(shape):
    rng = np.random.default_rng(shape[3])
    ctx = RoundCtx(seed=1, step=0, bits=8, rounding="stochastic")
    x = _mx(rng, shape, -3, -4, 4)  # many ties
    y, arg = _both(K.maxpool2d_forward, x, 2, 2, 0)
    dy = _mx(rng, y.m.shape, -9)
    _both(K.maxpool2d_backward, dy, arg, shape, 2, 2, 0, ctx, 16)


def test_relu_backward():
    rng = np.random.default_rng(0)
    x, dy = _mx(rng, (5, 4, 6, 6)), _mx(rng, (5, 4, 6, 6))
    ref = np.where(x.m > 0, dy.m, 0).astype(np.int8)
    _eq(K.relu_backward(dy, x).m, ref)
    mask = x.m > 0
    _eq(K.relu_backward(dy, mask).m, ref)
    assert np.array_equal(mask, x.m > 0)  # the caller's mask is not modified


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_round_shift_blocked(rounding):
    rng = np.random.default_rng(1)
    x = rng.integers(-(2**20), 2**20, (50, 7, 300)).astype(np.int32)
    s = rng.integers(0, 12, (1, 7, 1))
    amax = int(np.abs(x).max())
    _eq(round_shift_blocked(x, s, amax, rounding, 77), round_shift32(x, s, amax, rounding, 77))


def test_fast_paths_taken():
    from mexc.kernels import norm

    rng = np.random.default_rng(2)
    ctx = RoundCtx(seed=3, step=2, bits=8, rounding="stochastic")
    x = _mx(rng, (64, 8, 12, 12), -5, -60, 100)
    gamma, beta = _mx(rng, (8,), -6), _mx(rng, (8,), 0, -3, 4)
    fwd = norm._forward_train_fast(x, gamma, beta, 1e-5, ctx, 64)
    assert fwd is not None
    assert norm._backward_fast(_mx(rng, (64, 8, 12, 12), -17), fwd[1], ctx, 96) is not None
