"""Transformer kernels (LayerNorm, GELU, softmax, batched matmul, scale, broadcast add, token
mean, token-wise Linear): gradient checks against torch autograd on the dequantized inputs,
softmax normalization, determinism, and a worst-case ViT-tiny block under overflow debugging."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import cos, rand_mx, same, tt, worst_mx

from mexc import kernels as K
from mexc.mx import MX, RoundCtx
from mexc.numerics import FixedScalar, overflow_debug

B, T, D, H = 4, 16, 64, 4
DH = D // H
CTXS = [RoundCtx("stochastic", 3, 7), RoundCtx("nearest")]
CTX_IDS = ["stochastic", "nearest"]


def _ln_input(rng: np.random.Generator, shape: tuple[int, ...]) -> MX:
    """Rows with different offsets and spreads (as residual streams have)."""
    rows = shape[:-1] + (1,)
    base = rng.integers(-127, 128, shape)
    scale = rng.integers(1, 5, rows)
    off = rng.integers(-30, 30, rows)
    return MX.of(np.clip(base // scale + off, -127, 127), -4)


# ----------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("ctx", CTXS, ids=CTX_IDS)
def test_layernorm_matches_torch(ctx: RoundCtx) -> None:
    rng = np.random.default_rng(1)
    x = _ln_input(rng, (B, T, D))
    g = MX.of(rng.integers(40, 128, D), -7)
    b = rand_mx(rng, (D,), -8)
    y, saved = K.layernorm_forward(x, g, b, 1e-5, ctx, 0)
    assert y.shape == x.shape and y.e.ndim == 0
    xt, gt, bt = tt(x, True), tt(g, True), tt(b, True)
    yt = F.layer_norm(xt, (D,), gt, bt, eps=1e-5)
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    xf = x.dequantize().reshape(-1, D)
    assert np.allclose(saved.mean.dequantize(), xf.mean(1), atol=2.0**-11)
    assert np.allclose(saved.var.dequantize(), xf.var(1), rtol=2e-3)
    dy = rand_mx(rng, (B, T, D), -9)
    yt.backward(tt(dy))
    dx, dg, db = K.layernorm_backward(dy, saved, ctx, 16)
    assert dx.shape == x.shape and dx.e.ndim == 0
    assert dg.a.shape == (D,) and db.a.shape == (D,)
    assert cos(dx.dequantize(), xt.grad) >= 0.99
    assert cos(dg.dequantize(), gt.grad) >= 0.99
    assert np.allclose(db.dequantize(), bt.grad.numpy())


def test_layernorm_constant_rows_and_wide_rows() -> None:
    """Zero-variance rows give xhat = 0 (eps only); D = 768 (ViT-B) and D = 2048 (the backward
    pre-shifts g: 21 + ceil log2 D > 31), the latter under overflow debugging."""
    rng = np.random.default_rng(2)
    ctx = RoundCtx("stochastic", 1, 1)
    x = MX.of(np.full((3, D), 17), -3)
    g, b = MX.of(np.full(D, 64), -6), MX.of(np.full(D, 5), -4)
    y, _ = K.layernorm_forward(x, g, b, 1e-5, ctx, 0)
    assert np.allclose(y.dequantize(), 5 * 2.0**-4)
    for dw in (768, 2048):
        x = _ln_input(rng, (6, dw))
        g, b = MX.of(rng.integers(40, 128, dw), -7), rand_mx(rng, (dw,), -8)
        dy = worst_mx(rng, (6, dw), -9)
        with overflow_debug(dw == 2048):
            y, saved = K.layernorm_forward(x, g, b, 1e-5, ctx, 0)
            dx, dgm, _ = K.layernorm_backward(dy, saved, ctx, 16)
        xt, gt = tt(x, True), tt(g, True)
        yt = F.layer_norm(xt, (dw,), gt, tt(b), eps=1e-5)
        yt.backward(tt(dy))
        assert cos(y.dequantize(), yt.detach()) >= 0.99
        assert cos(dx.dequantize(), xt.grad) >= 0.99
        assert cos(dgm.dequantize(), gt.grad) >= 0.99


# ----------------------------------------------------------------------------------- GELU


@pytest.mark.parametrize("ctx", CTXS, ids=CTX_IDS)
@pytest.mark.parametrize("e", [-13, -9, -6, -4, -2])
def test_gelu_matches_torch(ctx: RoundCtx, e: int) -> None:
    """x Phi(x) keeps x's precision at every scale: e = -13 (inputs up to 0.016, where a table of
    GELU's values at 2^-5 gave zeros) to -2 (up to 31.8, past Phi's table: its clamped ends)."""
    rng = np.random.default_rng(3)
    x = rand_mx(rng, (B, T, 2 * D), e)
    y = K.gelu_forward(x, ctx, 0)
    xt = tt(x, True)
    yt = F.gelu(xt)
    assert cos(y.dequantize(), yt.detach()) >= 0.999
    # Phi's index rounding (at most 0.4 * 2^-5 stochastic, half that nearest) times |x|, plus
    # the output compaction's rounding
    unit = 2.0 ** int(y.e)
    step = 2.0**-5 if ctx.rounding == "stochastic" else 2.0**-6
    tol = 0.4 * step * np.abs(x.dequantize()) + (unit if ctx.rounding == "stochastic" else unit / 2)
    assert np.all(np.abs(y.dequantize() - yt.detach().numpy()) <= tol + 1e-12)
    dy = rand_mx(rng, x.shape, -9)
    yt.backward(tt(dy))
    dx = K.gelu_backward(dy, x, ctx, 16)
    assert cos(dx.dequantize(), xt.grad) >= 0.999


def test_gelu_examples_and_huge_exponent() -> None:
    """docs/numerics.md section 9's examples: x Phi(x) at a fine and at a coarse scale."""
    ctx = RoundCtx("nearest")
    y = K.gelu_forward(MX.of(np.array([-64, -16, 0, 16, 32, 64]), -5), ctx, 0)
    assert (y.m.tolist(), int(y.e)) == ([-3, -10, 0, 22, 54, 125], -6)
    y = K.gelu_forward(MX.of(np.array([-100, 0, 40, 100]), -12), ctx, 0)
    assert (y.m.tolist(), int(y.e)) == ([-98, 0, 40, 102], -13)
    x = MX.of(np.array([-5, 0, 3]), 4)  # -80, 0, 48: past the table, Phi(-4) and Phi(3.97)
    assert np.array_equal(K.gelu_forward(x, ctx, 0).dequantize(), [0, 0, 48])


# -------------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("ctx", CTXS, ids=CTX_IDS)
def test_softmax_matches_torch(ctx: RoundCtx) -> None:
    rng = np.random.default_rng(4)
    x = rand_mx(rng, (B, H, T, T), -4)  # logits in [-8, 8]
    p = K.softmax_forward(x, ctx, 0)
    assert p.m.min() >= 0 and p.m.max() <= 127 and int(p.e) == K.softmax_prob_exp(8) == -7
    xt = tt(x, True)
    pt = torch.softmax(xt, -1)
    assert cos(p.dequantize(), pt.detach()) >= 0.99
    sums = p.dequantize().sum(-1)
    tol = (0.5 if ctx.rounding == "nearest" else 1.0) * T / 128 + 1 / 128
    assert np.abs(sums - 1).max() <= tol
    assert abs(sums.mean() - 1) <= 0.02
    dy = rand_mx(rng, x.shape, -9)
    pt.backward(tt(dy))
    dx = K.softmax_backward(dy, p, ctx, 16)
    assert dx.shape == x.shape and dx.e.ndim == 0
    assert cos(dx.dequantize(), xt.grad) >= 0.99


def test_softmax_one_hot_and_uniform() -> None:
    ctx = RoundCtx("nearest")
    x = MX.of(np.array([[0, 0, 0, 0], [100, 0, 0, 0]]), -2)
    p = K.softmax_forward(x, ctx, 0)
    assert np.array_equal(p.m, [[32, 32, 32, 32], [127, 0, 0, 0]])


# --------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("ctx", CTXS, ids=CTX_IDS)
def test_attention_matmuls_match_torch(ctx: RoundCtx) -> None:
    rng = np.random.default_rng(5)
    q, k = rand_mx(rng, (B, H, T, DH), -6), rand_mx(rng, (B, H, T, DH), -6)
    kt = MX(np.ascontiguousarray(np.swapaxes(k.m, -1, -2)), k.e)  # layout op: exponent kept
    s = K.matmul_forward(q, kt, ctx, 0)
    qt, ktt = tt(q, True), tt(kt, True)
    st = qt @ ktt
    assert s.shape == (B, H, T, T)
    assert cos(s.dequantize(), st.detach()) >= 0.99
    dy = rand_mx(rng, s.shape, -9)
    st.backward(tt(dy))
    dq, dk = K.matmul_backward(dy, q, kt, ctx, 16)
    assert cos(dq.dequantize(), qt.grad) >= 0.99
    assert cos(dk.dequantize(), ktt.grad) >= 0.99
    # p @ v with unsigned probabilities
    p = K.softmax_forward(rand_mx(rng, (B, H, T, T), -4), ctx, 32)
    v = rand_mx(rng, (B, H, T, DH), -5)
    o = K.matmul_forward(p, v, ctx, 48)
    pt, vt = tt(p, True), tt(v, True)
    ot = pt @ vt
    assert cos(o.dequantize(), ot.detach()) >= 0.99
    do = rand_mx(rng, o.shape, -9)
    ot.backward(tt(do))
    dp, dv = K.matmul_backward(do, p, v, ctx, 64)
    assert cos(dp.dequantize(), pt.grad) >= 0.99
    assert cos(dv.dequantize(), vt.grad) >= 0.99


def test_matmul_preshift_long_reduction() -> None:
    """K = 2^18 takes the pre-shift (product_cap < 0) and stays exact enough."""
    rng = np.random.default_rng(6)
    ctx = RoundCtx("nearest")
    a, b = worst_mx(rng, (1, 2, 1 << 18), -7), worst_mx(rng, (1, 1 << 18, 2), -7)
    with overflow_debug():
        y = K.matmul_forward(a, b, ctx, 0)
    ref = a.dequantize() @ b.dequantize()
    assert cos(y.dequantize(), ref) >= 0.99


# ------------------------------------------------------------------------ scale / add / mean


@pytest.mark.parametrize("d_head", [16, 24])
def test_scale_matches_torch(d_head: int) -> None:
    rng = np.random.default_rng(7)
    ctx = RoundCtx("stochastic", 5, 2)
    s = FixedScalar.of(1 / math.sqrt(d_head))
    x = rand_mx(rng, (B, H, T, T), -3)
    y = K.scale_forward(x, s, ctx, 0)
    assert np.allclose(y.dequantize(), x.dequantize() / math.sqrt(d_head), atol=2.0 ** int(y.e))
    if d_head == 16:  # a power of two is exact
        assert np.array_equal(y.dequantize(), x.dequantize() / 4)
    dy = rand_mx(rng, x.shape, -9)
    dx = K.scale_backward(dy, s, ctx, 16)
    assert cos(dx.dequantize(), dy.dequantize() / math.sqrt(d_head)) >= 0.999


def test_add_broadcast_matches_torch() -> None:
    rng = np.random.default_rng(8)
    ctx = RoundCtx("stochastic", 2, 3)
    x, p = rand_mx(rng, (B, T + 1, D), -4), rand_mx(rng, (1, T + 1, D), -7)
    y = K.add_broadcast_forward(x, p, ctx, 0)
    xt, pt = tt(x, True), tt(p, True)
    yt = xt + pt
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, x.shape, -9)
    yt.backward(tt(dy))
    dp = K.add_broadcast_param_grad(dy)
    assert dp.a.shape == p.shape
    assert np.allclose(dp.dequantize(), pt.grad.numpy())
    with pytest.raises(ValueError):
        K.add_broadcast_forward(x, rand_mx(rng, (1, T, D), -7), ctx, 0)


@pytest.mark.parametrize("t", [16, 17, 49])
def test_mean_tokens_matches_torch(t: int) -> None:
    rng = np.random.default_rng(9)
    ctx = RoundCtx("stochastic", 4, 4)
    x = rand_mx(rng, (B, t, D), -4)
    y = K.mean_tokens_forward(x, ctx, 0)
    xt = tt(x, True)
    yt = xt.mean(1)
    assert y.shape == (B, D)
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, (B, D), -9)
    yt.backward(tt(dy))
    dx = K.mean_tokens_backward(dy, t, ctx, 16)
    assert dx.shape == x.shape
    assert cos(dx.dequantize(), xt.grad) >= 0.99


def test_tokenwise_linear_is_linear_on_flattened_tokens() -> None:
    rng = np.random.default_rng(10)
    ctx = RoundCtx("stochastic", 6, 1)
    x, w, bias = (
        rand_mx(rng, (B, T, D), -4),
        rand_mx(rng, (2 * D, D), -9),
        rand_mx(rng, (2 * D,), -8),
    )
    y = K.linear_forward(x, w, bias, ctx, 0)
    xt, wt, bt = tt(x, True), tt(w, True), tt(bias, True)
    yt = F.linear(xt, wt, bt)
    assert y.shape == (B, T, 2 * D)
    assert cos(y.dequantize(), yt.detach()) >= 0.99
    dy = rand_mx(rng, y.shape, -9)
    yt.backward(tt(dy))
    dx = K.linear_backward_input(dy, w, ctx, 16)
    dw = K.linear_backward_weight(dy, x, ctx, 16)
    db = K.bias_backward(dy, (0, 1))
    assert dx.shape == x.shape and cos(dx.dequantize(), xt.grad) >= 0.99
    assert np.allclose(dw.dequantize(), wt.grad.numpy())  # un-compacted: exact
    assert np.allclose(db.dequantize(), bt.grad.numpy())


# ------------------------------------------------------------------ attention end to end


def _split_heads(x: MX) -> MX:  # [B, T, D] -> [B, H, T, DH] (layout op)
    b, t, _ = x.shape
    return MX(np.ascontiguousarray(x.m.reshape(b, t, H, DH).transpose(0, 2, 1, 3)), x.e)


def _merge_heads(x: MX) -> MX:
    b, _, t, _ = x.shape
    return MX(np.ascontiguousarray(x.m.transpose(0, 2, 1, 3).reshape(b, t, D)), x.e)


def _t(x: MX) -> MX:
    return MX(np.ascontiguousarray(np.swapaxes(x.m, -1, -2)), x.e)


def test_attention_head_end_to_end_matches_torch() -> None:
    """LN -> q, k, v projections -> softmax(q k^T / sqrt(dh)) v -> merge, forward and dx."""
    rng = np.random.default_rng(11)
    ctx = RoundCtx("stochastic", 9, 1)
    x = _ln_input(rng, (B, T, D))
    g, b = MX.of(rng.integers(60, 128, D), -7), rand_mx(rng, (D,), -9)
    ws = [rand_mx(rng, (D, D), -8) for _ in range(3)]
    sc = FixedScalar.of(1 / math.sqrt(DH))
    hn, ln_s = K.layernorm_forward(x, g, b, 1e-5, ctx, 0)
    q, k, v = (
        _split_heads(K.linear_forward(hn, w, None, ctx, 16 * (i + 1))) for i, w in enumerate(ws)
    )
    s = K.scale_forward(K.matmul_forward(q, _t(k), ctx, 64), sc, ctx, 80)
    p = K.softmax_forward(s, ctx, 96)
    o = _merge_heads(K.matmul_forward(p, v, ctx, 112))
    xt = tt(x, True)
    ht = F.layer_norm(xt, (D,), tt(g), tt(b), eps=1e-5)
    qt, kt, vt = (F.linear(ht, tt(w)).reshape(B, T, H, DH).transpose(1, 2) for w in ws)
    pt = torch.softmax(qt @ kt.transpose(-1, -2) / math.sqrt(DH), -1)
    ot = (pt @ vt).transpose(1, 2).reshape(B, T, D)
    assert cos(p.dequantize(), pt.detach()) >= 0.99
    assert cos(o.dequantize(), ot.detach()) >= 0.99
    do = rand_mx(rng, (B, T, D), -9)
    ot.backward(tt(do))
    dp, dv = K.matmul_backward(_split_heads(do), p, v, ctx, 128)
    ds = K.scale_backward(K.softmax_backward(dp, p, ctx, 144), sc, ctx, 160)
    dq, dkt = K.matmul_backward(ds, q, _t(k), ctx, 176)
    dh = [
        K.linear_backward_input(_merge_heads(d), w, ctx, 192 + 16 * i)
        for i, (d, w) in enumerate(zip([dq, _t(dkt), dv], ws))
    ]
    dhn = K.grad_sum(dh, ctx, 240)
    dx, _, _ = K.layernorm_backward(dhn, ln_s, ctx, 256)
    assert cos(dx.dequantize(), xt.grad) >= 0.99


# ---------------------------------------------------------------------------- determinism


def _all_kernels(ctx: RoundCtx) -> list[MX]:
    rng = np.random.default_rng(12)
    x = _ln_input(rng, (B, T, D))
    g, b = MX.of(rng.integers(40, 128, D), -7), rand_mx(rng, (D,), -8)
    dy = rand_mx(rng, x.shape, -9)
    y, saved = K.layernorm_forward(x, g, b, 1e-5, ctx, 0)
    dx, _, _ = K.layernorm_backward(dy, saved, ctx, 16)
    a = rand_mx(rng, (B, H, T, T), -4)
    p = K.softmax_forward(a, ctx, 32)
    ds = K.softmax_backward(rand_mx(rng, a.shape, -9), p, ctx, 48)
    gl = K.gelu_forward(x, ctx, 64)
    gb = K.gelu_backward(dy, x, ctx, 80)
    mm = K.matmul_forward(p, rand_mx(rng, (B, H, T, DH), -5), ctx, 96)
    mt = K.mean_tokens_forward(x, ctx, 112)
    return [y, dx, p, ds, gl, gb, mm, mt]


def test_determinism() -> None:
    st = RoundCtx("stochastic", 1, 1)
    assert all(same(a, b) for a, b in zip(_all_kernels(st), _all_kernels(st)))
    other = _all_kernels(RoundCtx("stochastic", 1, 2))
    assert not all(same(a, b) for a, b in zip(_all_kernels(st), other))
    n0, n5 = _all_kernels(RoundCtx("nearest", 0, 0)), _all_kernels(RoundCtx("nearest", 3, 5))
    assert all(same(a, b) for a, b in zip(n0, n5))


# ------------------------------------------------------------------------- overflow debug


def test_vit_tiny_block_worst_case_no_overflow() -> None:
    """Worst-case (+-127) mantissas through a ViT-tiny block at B = 128, T = 16, D = 64,
    4 heads, MLP 128: pos-embedding, LN, attention, residual, LN, MLP with GELU, residual,
    mean pooling, and the whole backward, with every int32 intermediate checked."""
    rng = np.random.default_rng(13)
    ctx = RoundCtx("stochastic", 0, 1)
    n, t, d, h, mlp = 128, 16, 64, 4, 128
    dh = d // h

    def heads(z: MX) -> MX:
        return MX(np.ascontiguousarray(z.m.reshape(n, t, h, dh).transpose(0, 2, 1, 3)), z.e)

    def merge(z: MX) -> MX:
        return MX(np.ascontiguousarray(z.m.transpose(0, 2, 1, 3).reshape(n, t, d)), z.e)

    x0 = worst_mx(rng, (n, t, d), -4)
    pos = worst_mx(rng, (1, t, d), -7)
    g1, b1 = MX.of(np.full(d, 127), -7), worst_mx(rng, (d,), -7)
    g2, b2 = MX.of(np.full(d, -127), -7), worst_mx(rng, (d,), -7)
    wq, wk, wv, wo = (worst_mx(rng, (d, d), -9) for _ in range(4))
    w1, bb1 = worst_mx(rng, (mlp, d), -9), worst_mx(rng, (mlp,), -7)
    w2, bb2 = worst_mx(rng, (d, mlp), -9), worst_mx(rng, (d,), -7)
    sc = FixedScalar.of(1 / math.sqrt(dh))
    with overflow_debug():
        x = K.add_broadcast_forward(x0, pos, ctx, 0)
        h1, s1 = K.layernorm_forward(x, g1, b1, 1e-6, ctx, 16)
        q, k, v = (
            heads(K.linear_forward(h1, w, None, ctx, 32 + 16 * i))
            for i, w in enumerate((wq, wk, wv))
        )
        kt = _t(k)
        sraw = K.matmul_forward(q, kt, ctx, 80)
        s = K.scale_forward(sraw, sc, ctx, 96)
        p = K.softmax_forward(s, ctx, 112)
        a = merge(K.matmul_forward(p, v, ctx, 128))
        ao = K.linear_forward(a, wo, None, ctx, 144)
        x2 = K.add_forward(x, ao, ctx, 160)
        h2, s2 = K.layernorm_forward(x2, g2, b2, 1e-6, ctx, 176)
        f1 = K.linear_forward(h2, w1, bb1, ctx, 192)
        gl = K.gelu_forward(f1, ctx, 208)
        f2 = K.linear_forward(gl, w2, bb2, ctx, 224)
        x3 = K.add_forward(x2, f2, ctx, 240)
        K.mean_tokens_forward(x3, ctx, 256)
        # backward with worst-case incoming gradients
        dpool = worst_mx(rng, (n, d), -9)
        dx3 = K.mean_tokens_backward(dpool, t, ctx, 272)
        dx3 = worst_mx(rng, dx3.shape, -9)
        dgl = K.linear_backward_input(dx3, w2, ctx, 288)
        K.linear_backward_weight(dx3, gl, ctx, 288)
        K.bias_backward(dx3, (0, 1))
        df1 = K.gelu_backward(dgl, f1, ctx, 304)
        K.gelu_backward(worst_mx(rng, f1.shape, -9), worst_mx(rng, f1.shape, -4), ctx, 304)
        dh2 = K.linear_backward_input(df1, w1, ctx, 320)
        K.linear_backward_weight(df1, h2, ctx, 320)
        dx2a, _, _ = K.layernorm_backward(dh2, s2, ctx, 336)
        K.layernorm_backward(worst_mx(rng, h2.shape, -9), s2, ctx, 336)
        dx2 = K.grad_sum([dx3, dx2a], ctx, 352)
        da = K.linear_backward_input(dx2, wo, ctx, 368)
        K.linear_backward_weight(dx2, a, ctx, 368)
        dp, dv = K.matmul_backward(heads(da), p, v, ctx, 384)
        K.matmul_backward(worst_mx(rng, (n, h, t, dh), -9), p, v, ctx, 384)
        ds = K.softmax_backward(dp, p, ctx, 400)
        K.softmax_backward(worst_mx(rng, p.shape, -9), p, ctx, 400)
        dsraw = K.scale_backward(ds, sc, ctx, 416)
        dq, dkt = K.matmul_backward(dsraw, q, kt, ctx, 432)
        K.matmul_backward(worst_mx(rng, dsraw.shape, -9), q, kt, ctx, 432)
        dh1 = [
            K.linear_backward_input(merge(z), w, ctx, 448 + 16 * i)
            for i, (z, w) in enumerate(zip((dq, _t(dkt), dv), (wq, wk, wv)))
        ]
        dx1, _, _ = K.layernorm_backward(K.grad_sum(dh1, ctx, 496), s1, ctx, 512)
        dx = K.grad_sum([dx2, dx1], ctx, 528)
        K.add_broadcast_param_grad(dx)
        K.add_broadcast_param_grad(worst_mx(rng, x.shape, -9))
        # worst-case probabilities and logits straight into the kernels too
        K.softmax_forward(worst_mx(rng, s.shape, 3), ctx, 112)
        K.gelu_forward(worst_mx(rng, f1.shape, 0), ctx, 208)
