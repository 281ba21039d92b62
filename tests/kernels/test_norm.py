import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import cos, rand_mx, same, tt

from mexc.kernels import (
    batchnorm_backward,
    batchnorm_forward_eval,
    batchnorm_forward_train,
    batchnorm_update_running,
)
from mexc.mx import MX, RoundCtx
from mexc.numerics import FixedScalar


@pytest.mark.parametrize("shape", [(8, 8, 8, 8), (64, 16)])
def test_batchnorm_train_matches_torch(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    ctx = RoundCtx("stochastic", 1, 1)
    c = shape[1]
    x = MX.of(
        rng.integers(-127, 128, shape) // 3
        + rng.integers(-20, 20, (1, c) + (1,) * (len(shape) - 2)),
        -5,
    )
    g = MX.of(rng.integers(30, 128, c), -7)
    b = rand_mx(rng, (c,), -7)
    y, saved = batchnorm_forward_train(x, g, b, 1e-5, ctx, 0)
    xt, gt, bt = tt(x, True), tt(g, True), tt(b, True)
    yt = F.batch_norm(xt, None, None, gt, bt, training=True, eps=1e-5)
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, shape, -9)
    yt.backward(tt(dy))
    dx, dg, db = batchnorm_backward(dy, saved, ctx, 16)
    assert cos(dx.dequantize(), xt.grad) >= 0.99
    assert cos(dg.dequantize(), gt.grad) >= 0.99
    assert np.allclose(db.dequantize(), bt.grad.numpy())
    axes = (0, 2, 3) if len(shape) == 4 else (0,)
    xf = x.dequantize()
    assert np.allclose(saved.mean.dequantize(), xf.mean(axes), atol=2.0**-12)
    assert np.allclose(saved.var.dequantize(), xf.var(axes), rtol=1e-3)
    # deterministic
    y2, _ = batchnorm_forward_train(x, g, b, 1e-5, ctx, 0)
    assert same(y, y2)
    dx2, _, _ = batchnorm_backward(dy, saved, ctx, 16)
    assert same(dx, dx2)


def test_batchnorm_running_and_eval() -> None:
    rng = np.random.default_rng(5)
    ctx = RoundCtx("nearest")
    c = 8
    x = rand_mx(rng, (16, c, 4, 4), -4)
    g, b = MX.of(rng.integers(30, 128, c), -7), rand_mx(rng, (c,), -7)
    _, saved = batchnorm_forward_train(x, g, b, 1e-5, ctx, 0)
    rm0 = MX.of(np.zeros(c), np.zeros(c, np.int64))
    rv0 = MX.of(np.full(c, 64), np.full(c, -6))  # 1.0 per channel
    mom = FixedScalar.of(0.1)
    rm, rv = batchnorm_update_running(rm0, rv0, saved.mean, saved.var_unbiased, mom, ctx, 32)
    trm, trv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    F.batch_norm(tt(x), trm, trv, None, None, training=True, momentum=0.1)
    assert np.allclose(rm.dequantize(), trm.numpy(), atol=0.02)
    assert np.allclose(rv.dequantize(), trv.numpy(), rtol=0.02)
    # per-tensor running statistics are supported too
    rm1, rv1 = batchnorm_update_running(
        MX.of(np.zeros(c), 0),
        MX.of(np.full(c, 64), -6),
        saved.mean,
        saved.var_unbiased,
        mom,
        ctx,
        32,
    )
    assert rm1.e.ndim == 0 and np.allclose(rv1.dequantize(), trv.numpy(), rtol=0.05)
    for rmx_, rvx in [(rm, rv), (rm1, rv1)]:
        ye = batchnorm_forward_eval(x, g, b, rmx_, rvx, ctx, 48)
        yt = F.batch_norm(tt(x), tt(rmx_), tt(rvx), tt(g), tt(b), training=False)
        assert cos(ye.dequantize(), yt) >= 0.99


def test_batchnorm_backward_keeps_dense_terms_of_sparse_gradients() -> None:
    """After ReLU/max-pool routing most of dy is zero; there dx is only the dense mean terms
    -gamma*rstd*(mean(dy) + xhat*mean(dy*xhat)), a fraction of one unit of dx. They must survive
    on average: what a weight gradient sees (sum over positions of dx times an input) has to
    match float. A per-element round(T / M) once rounded them to zero everywhere."""
    rng = np.random.default_rng(11)
    ctx = RoundCtx("stochastic", 3, 1)
    n, c, hw = 32, 4, 16
    shape = (n, c, hw, hw)
    x = MX.of(rng.integers(-100, 101, shape), -5)
    g = MX.of(rng.integers(40, 128, c), -7)
    b = rand_mx(rng, (c,), -7)
    _, saved = batchnorm_forward_train(x, g, b, 1e-5, ctx, 0)
    dym = np.where(rng.random(shape) < 0.04, rng.integers(1, 4, shape), 0)
    dy = MX.of(dym, -9)  # one-signed: the mean terms are large where dy is zero
    xt, gt, bt = tt(x, True), tt(g, True), tt(b, True)
    F.batch_norm(xt, None, None, gt, bt, training=True, eps=1e-5).backward(tt(dy))
    dx, _, _ = batchnorm_backward(dy, saved, ctx, 16)
    assert xt.grad is not None
    want = xt.grad.numpy()
    got = dx.dequantize()
    zero = dym == 0
    # the dense part, summed per channel over the positions where dy = 0
    dense_want = (want * zero).sum(axis=(0, 2, 3))
    dense_got = (got * zero).sum(axis=(0, 2, 3))
    assert np.allclose(dense_got, dense_want, rtol=0.05)
    # and what a 1x1 convolution's weight gradient would see from a dense input
    z = rng.standard_normal(shape)
    assert np.allclose((got * z).sum(axis=(0, 2, 3)), (want * z).sum(axis=(0, 2, 3)), rtol=0.1)
