"""Batch normalization (training forward, backward, running statistics) as TIR kernels.

The TE form of `mexc.kernels.norm` (docs/layers.md), kernel by kernel; the tests build each for
llvm and compare it with the reference bit for bit. The input is seen as (N, C, S) with
S = H*W (or 1), so the flat index of an element, which keys its random bits, is the natural one.
Per-channel scalar work (statistics, the integer square root, the reciprocal, the dx factor) runs
as chains of small (C,) stages. Divisions by the static count M use `tirx.floordiv` by a
constant (an integer multiply-high on every target); the one run-time division, 2^29 / sigma, is
`te_divide`'s long division. The integer square root is bit by bit: sixteen (C,) stages, each
setting one bit of the root if its square still fits (floor(sqrt(n)) for n < 2^32).

Kernels of the forward pass, in launch order (sites of kernels.batchnorm_forward_train):
    bn_stats     mu = round((sum x) << f / M), r = the variance pre-shift        per channel
    bn_var       var (biased / unbiased), its exponent ev, rstd and its exponent  [0]
    bn_xhat_shift / bn_xhat_apply   xhat = compact_common(acc, e_grp) with
                 acc = ((x << f) - mu) * rstd computed in both, e_grp = ex - f + rstd_e  [1]
    bn_affine_compaction   gamma * xhat + beta aligned [2] [3], compacted without being
                 stored (shift and apply kernels)                                 [4]
Backward (kernels.batchnorm_backward): bn_grad_sums, to_bits (dgamma -> 16 bits [0]),
bn_bracket [1] [2] [3], to_bits_shift (T -> 16 bits), bn_dx_factor [5], bn_dx_acc (with
to_bits' rounding of T [4]), common_shift / common_apply [6]. Lean (no int32 tensor stored):
bn_bracket_max, then bn_dx_unstored's shift and apply, which compute T again. Running statistics
(kernels.batchnorm_update_running): to_bits, bn_ema, and a grouped compaction, once for the
mean (sites 0-3) and once for the variance (4-7).
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import s_tir, te, tirx

from mexc.kernels.norm import EPS_BITS, RSTD_NUM_LOG2
from mexc.lowering.te_compaction import (
    LANE_REDUCE,
    _flat_index,
    abs_max_all,
    aligned_target,
    compacted,
    fit_shift,
    fused_compaction,
    iabs,
    shift_right32,
    shift_signed,
    shift_signed32,
    where,
)
from mexc.lowering.te_compaction import _i64 as _c
from mexc.lowering.te_divide import idiv_round
from mexc.lowering.te_func import prim_func, trial_cached
from mexc.numerics import FixedScalar, ceil_log2, qmax

I8, I32, I64 = "int8", "int32", "int64"
NCS = tuple[int, int, int]
BIG = 1 << 20  # below every exponent the step produces


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


def _div_const(a: tirx.PrimExpr, m: int) -> tirx.PrimExpr:
    """numerics.idiv_round(a, m) for a constant m > 0 (int64)."""
    q = tirx.floordiv(iabs(a) + _c(m // 2), _c(m))
    return where(a < 0, -q, q)


def _nearest(x: tirx.PrimExpr, t: tirx.PrimExpr) -> tirx.PrimExpr:
    """numerics.shift_signed(x, t, "nearest")."""
    return shift_signed(x, t, _c(0), _c(0), False)


def _bitlen(v: te.Tensor, name: str) -> te.Tensor:
    """Per element bit length of |v| for a (C,) int64 tensor with |v| < 2^62: how many of
    2^0 .. 2^61 are at most |v|, one flat sum of compares per element. Not a loop: a 62-step
    count per element was a serial inner loop (LayerNorm's rows are its channels: its 1/sigma
    kernel on 6272 x 48, 2-core Zen 3, 2026-12-02: 0.45 -> 0.40 ms with a binary search). Not a
    binary search either: each of its six steps read the one before twice, and TVM's buffer
    analysis substitutes such Let chains, 2^6 copies per element (each kernel that takes a bit
    length spent 0.1-0.3 s in CompactBufferAllocation)."""

    def body(c: tirx.PrimExpr) -> tirx.PrimExpr:
        a = iabs(v[c])
        count: tirx.PrimExpr = (a >= _c(1)).astype(I32)
        for k in range(1, 62):
            count = count + (a >= _c(1 << k)).astype(I32)
        return count

    return te.compute(v.shape, body, name=name)


def isqrt_stages(n: te.Tensor, name: str = "isqrt") -> te.Tensor:
    """floor(sqrt(n)) of a (C,) int64 tensor with 0 <= n < 2^32, one stage per result bit."""

    def stage(prev: te.Tensor, b: int) -> te.Tensor:
        def step(c: tirx.PrimExpr) -> tirx.PrimExpr:
            cand = prev[c] | _c(1 << b)
            return tirx.if_then_else(cand * cand <= n[c], cand, prev[c])

        return te.compute(n.shape, step, name=f"{name}_{b}")

    res = te.compute(n.shape, lambda c: _c(0), name=f"{name}_16")
    for b in range(15, -1, -1):
        res = stage(res, b)
    return res


def _per_channel(shape: NCS, body: Callable[..., tirx.PrimExpr], name: str) -> te.Tensor:
    return te.compute((shape[1],), body, name=name)


def _to_i32(t: te.Tensor) -> te.Tensor:
    return te.compute(t.shape, lambda c: t[c].astype(I32), name=f"{t.name}_out")


def _ncs_sum(
    shape: NCS,
    value: Callable[..., tirx.PrimExpr],
    name: str,
    dtype: str = I64,
    lanes: bool = False,
) -> te.Tensor:
    """Per channel sum over (n, s) of value(n, c, s), int64: per (n, c) over s first (rows in
    parallel, s contiguous, in `dtype` where the caller bounds the sum), then over n. `lanes`:
    the sum over s is marked LANE_REDUCE (a value with a rounding's hash in it, which LLVM
    leaves scalar in a short loop: LayerNorm's 1/sigma kernel on 6272 x 48, 0.40 -> 0.29 ms)."""
    rs = te.reduce_axis((0, shape[2]), f"{name}_s")
    part = te.compute(
        shape[:2],
        lambda n, c: te.sum(value(n, c, rs), axis=rs),
        name=f"{name}_nc",
        attrs={LANE_REDUCE: 1} if lanes else None,
    )
    rn = te.reduce_axis((0, shape[0]), f"{name}_n")
    return _per_channel(shape, lambda c: te.sum(part[rn, c].astype(I64), axis=rn), name)


# ----------------------------------------------------------------------------------- forward


@trial_cached()
def bn_stats(shape: NCS, f: int, name: str = "bn_stats") -> tirx.PrimFunc:
    """mu = idiv_round(sum x << f, M) and the variance pre-shift r (smallest with
    M * ceil(max|xc| / 2^r)^2 <= 2^31 - 1, xc = (x << f) - mu). Parameters (x, mu, r)."""
    m = shape[0] * shape[2]
    x = te.placeholder(shape, I8, name="x")
    ssum = _ncs_sum(shape, lambda n, c, s: x[n, c, s].astype(I64), "ssum")
    mu = _per_channel(shape, lambda c: _div_const(ssum[c] << _c(f), m), "mu64")
    rs = te.reduce_axis((0, shape[2]), "as")
    part = te.compute(
        shape[:2],
        lambda n, c: te.max(iabs((x[n, c, rs].astype(I64) << _c(f)) - mu[c]), axis=rs),
        name="amax_nc",
    )
    rn = te.reduce_axis((0, shape[0]), "an")
    amax = _per_channel(shape, lambda c: te.max(part[rn, c], axis=rn), "amax")
    t = te.reduce_axis((0, 32), "t")

    def over(c: tirx.PrimExpr) -> tirx.PrimExpr:
        tt = t.var.astype(I64)
        top = (amax[c] + (_c(1) << tt) - 1) >> tt
        return te.sum(tirx.if_then_else(_c(m) * top * top > _c(2**31 - 1), 1, 0), axis=t)

    r = _per_channel(shape, over, "r")
    mu32 = _per_channel(shape, lambda c: mu[c].astype(I32), "mu")
    return _func([x, mu32, r], name)


def _rstd_stages(
    var_m: te.Tensor, ev: te.Tensor, eps: FixedScalar, native: bool
) -> tuple[te.Tensor, te.Tensor]:
    """kernels.norm._rstd on (C,) int64 stages: (rstd, rstd_e); `native`: the division by the
    target's integer divide (te_divide.idiv_round)."""
    shape = var_m.shape

    def rise(c: tirx.PrimExpr) -> tirx.PrimExpr:
        """eps_rise: k for channel c."""
        if eps.num == 0:
            return _c(0)
        return tirx.max(_c(eps.num.bit_length() - EPS_BITS - eps.shift) - ev[c], _c(0))

    k = te.compute(shape, rise, name="eps_rise")

    def n0_body(c: tirx.PrimExpr) -> tirx.PrimExpr:
        sh = _c(-eps.shift) - ev[c]
        left = _c(eps.num) << tirx.max(sh - k[c], _c(0))
        right = _nearest(_c(eps.num), tirx.max(-sh, _c(0)))
        var_a = _nearest(var_m[c], k[c])
        return tirx.max(var_a + tirx.if_then_else(sh >= 0, left, right), _c(1))

    n0 = te.compute(shape, n0_body, name="n0")
    bl = _bitlen(n0, "bl_n0")

    def t_body(c: tirx.PrimExpr) -> tirx.PrimExpr:
        t0 = _c(29) - bl[c].astype(I64)
        return t0 + ((ev[c] + k[c] - t0) & _c(1))

    t = te.compute(shape, t_body, name="t_norm")
    n = te.compute(shape, lambda c: _nearest(n0[c], -t[c]), name="n_norm")
    sigma = isqrt_stages(n)
    rstd = te.compute(
        shape, lambda c: idiv_round(_c(1 << RSTD_NUM_LOG2), sigma[c], native), name="rstd"
    )
    rstd_e = te.compute(
        shape, lambda c: _c(-RSTD_NUM_LOG2) - ((ev[c] + k[c] - t[c]) >> _c(1)), name="re"
    )
    return rstd, rstd_e


@trial_cached()
def bn_var(
    shape: NCS,
    f: int,
    eps: FixedScalar,
    stochastic: bool,
    name: str = "bn_var",
    native_division: bool = False,
) -> tirx.PrimFunc:
    """The batch variance and 1/sigma: tq = round(xc / 2^r) (site key), vsum = sum tq^2,
    sv = max(30 - bitlen(vsum), 0), var = idiv_round(vsum << sv, M) (unbiased: M - 1),
    ev = 2 (ex - f + r) - sv; rstd = 2^29 / isqrt(normalized var + eps) at rstd_e.
    Parameters (x, mu, r, ex, key, var, var_u, ev, rstd, rstd_e, e_c); e_c = ex - f."""
    m = shape[0] * shape[2]
    x = te.placeholder(shape, I8, name="x")
    mu = te.placeholder((shape[1],), I32, name="mu")
    r = te.placeholder((shape[1],), I32, name="r")
    ex = te.placeholder((1,), I32, name="ex")
    key = te.placeholder((1,), I64, name="key")

    # int32 lanes: |xc| < 2^16 (f <= 8) and r >= 0 is a right shift; r makes
    # M * ceil(max|xc| / 2^r)^2 <= 2^31 - 1, so every tq^2 and their per-channel sum fit int32
    def tq(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        xc = (x[n, c, s].astype(I32) << f) - mu[c]
        v = shift_right32(xc, r[c], key[0], _flat_index(shape, (n, c, s)), stochastic)
        return v * v

    vsum = _ncs_sum(shape, tq, "vsum", I32, lanes=True)
    outs = var_statistics(shape, vsum, r, ex, f, m, eps, native_division)
    return _func([x, mu, r, ex, key, *outs], name)


def var_statistics(
    shape: NCS,
    vsum: te.Tensor,
    r: te.Tensor,
    ex: te.Tensor,
    f: int,
    m: int,
    eps: FixedScalar,
    native_division: bool,
) -> list[te.Tensor]:
    """bn_var's results from the per-channel sum of squares vsum (int64 values): var, var_u,
    ev, rstd, rstd_e (int32) and e_c = ex - f."""
    bl = _bitlen(vsum, "bl_vsum")
    vnum = _per_channel(
        shape, lambda c: vsum[c] << tirx.max(_c(30) - bl[c].astype(I64), _c(0)), "vnum"
    )
    var_m = _per_channel(shape, lambda c: _div_const(vnum[c], m), "var_m")
    var_u = _per_channel(shape, lambda c: _div_const(vnum[c], m - 1), "var_u64")

    def ev_body(c: tirx.PrimExpr) -> tirx.PrimExpr:
        sv = tirx.max(_c(30) - bl[c].astype(I64), _c(0))
        return _c(2) * (ex[0].astype(I64) - f + r[c].astype(I64)) - sv

    ev = _per_channel(shape, ev_body, "ev64")
    rstd, rstd_e = _rstd_stages(var_m, ev, eps, native_division)
    e_c = te.compute((1,), lambda _: ex[0] - f, name="e_c")
    return [*(_to_i32(t) for t in (var_m, var_u, ev, rstd, rstd_e)), e_c]


def _xhat_inputs(shape: NCS, f: int) -> tuple[list[te.Tensor], Callable[..., tirx.PrimExpr]]:
    """(x, mu, rstd) and the xhat accumulator ((x << f) - mu) * rstd (int32, |.| < 2^31) as a
    function of (n, c, s): computed where it is read instead of stored, so the normalization
    moves one byte per element instead of nine (an int32 write and two reads)."""
    x = te.placeholder(shape, I8, name="x")
    mu, rstd = (te.placeholder((shape[1],), I32, name=n) for n in ("mu", "rstd"))

    def acc(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return ((x[n, c, s].astype(I32) << f) - mu[c]) * rstd[c]

    return [x, mu, rstd], acc


@trial_cached()
def bn_xhat_shift(shape: NCS, f: int, bits: int, name: str = "bn_xhat_shift") -> tirx.PrimFunc:
    """common_shift of the xhat accumulator (`_xhat_inputs`), e_grp = e_c + rstd_e per channel.
    Parameters (x, mu, rstd, rstd_e, e_c, e_grp, sh, e_out)."""
    inputs, acc = _xhat_inputs(shape, f)
    rstd_e = te.placeholder((shape[1],), I32, name="re")
    e_c = te.placeholder((1,), I32, name="e_c")
    e_grp = te.compute((shape[1],), lambda c: e_c[0] + rstd_e[c], name="e_grp")
    sh, e_out = _common_shift(shape, acc, e_grp, bits)
    return _func([*inputs, rstd_e, e_c, e_grp, sh, e_out], name)


@trial_cached()
def bn_xhat_apply(
    shape: NCS, f: int, bits: int, stochastic: bool, name: str = "bn_xhat_apply"
) -> tirx.PrimFunc:
    """common_apply of the xhat accumulator. Parameters (x, mu, rstd, sh, key, m)."""
    inputs, acc = _xhat_inputs(shape, f)
    sh = te.placeholder((shape[1],), I32, name="sh")
    key = te.placeholder((1,), I64, name="key")
    m = _common_apply(shape, acc, sh, key, bits, stochastic)
    return _func([*inputs, sh, key, m], name)


def _common_shift(
    shape: NCS, acc: Callable[..., tirx.PrimExpr], e_grp: te.Tensor, bits: int
) -> tuple[te.Tensor, te.Tensor]:
    """(sh, e_out) of compact_common for the accumulator acc(n, c, s) (see common_shift)."""
    return common_shift_of(channel_abs_max(shape, acc), e_grp, bits)


def channel_abs_max(shape: NCS, acc: Callable[..., tirx.PrimExpr]) -> te.Tensor:
    """max |acc(n, c, s)| per channel (C,): per (n, c) with s innermost (n in parallel), then
    per channel over n."""
    rs = te.reduce_axis((0, shape[2]), "rs")
    part = te.compute(shape[:2], lambda n, c: te.max(iabs(acc(n, c, rs)), rs), name="amax_nc")
    rn = te.reduce_axis((0, shape[0]), "rn")
    return _per_channel(shape, lambda c: te.max(part[rn, c], axis=rn), "amax")


def common_tops(amax: te.Tensor, e_grp: te.Tensor, bits: int) -> te.Tensor:
    """(top, emax) int32 of compact_common from the groups' maxima amax (G,): the largest
    e_grp + s over the non-zero groups (-BIG where none) and the largest e_grp."""
    s = fit_shift(amax, qmax(bits))
    rc = te.reduce_axis((0, int(amax.shape[0])), "rc")
    top = te.compute(
        (1,),
        lambda _: te.max(
            tirx.if_then_else(amax[rc] > 0, e_grp[rc] + s[rc].astype(I32), -BIG), axis=rc
        ),
        name="top",
    )
    rc2 = te.reduce_axis((0, int(amax.shape[0])), "rc2")
    emax = te.compute((1,), lambda _: te.max(e_grp[rc2], axis=rc2), name="emax")
    return te.compute((2,), lambda i: tirx.Select(i == 0, top[0], emax[0]), name="tops")


def shift_of_tops(tops: te.Tensor, e_grp: te.Tensor) -> tuple[te.Tensor, te.Tensor]:
    """(sh, e_out) of compact_common from its (top, emax): e_out = top where a group is
    non-zero, else emax; sh_g = e_out - e_grp_g."""
    e_out = te.compute(
        (1,), lambda _: tirx.if_then_else(tops[0] > -BIG, tops[0], tops[1]), name="e_out"
    )
    sh = te.compute(e_grp.shape, lambda c: e_out[0] - e_grp[c], name="sh")
    return sh, e_out


def common_shift_of(amax: te.Tensor, e_grp: te.Tensor, bits: int) -> tuple[te.Tensor, te.Tensor]:
    """(sh, e_out) of compact_common from the per-channel maxima amax (C,)."""
    return shift_of_tops(common_tops(amax, e_grp, bits), e_grp)


def common_shift(shape: NCS, bits: int, name: str = "common_shift") -> tirx.PrimFunc:
    """kernels._common.compact_common's plan along axis 1: s_c = compaction shift of channel c,
    e_out = max over non-zero channels of e_grp + s_c (max e_grp if all are zero),
    sh_c = e_out - e_grp_c. Parameters (acc, e_grp, sh, e_out)."""
    acc = te.placeholder(shape, I32, name="acc")
    e_grp = te.placeholder((shape[1],), I32, name="e_grp")
    sh, e_out = _common_shift(shape, lambda n, c, s: acc[n, c, s], e_grp, bits)
    return _func([acc, e_grp, sh, e_out], name)


def _common_apply(
    shape: NCS,
    acc: Callable[..., tirx.PrimExpr],
    sh: te.Tensor,
    key: te.Tensor,
    bits: int,
    stochastic: bool,
) -> te.Tensor:
    def body(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        # sh_c >= 0 wherever the channel has a nonzero value (common_shift's e_out is at least
        # e_grp_c + s_c there): int32 lanes, and no left shift (a zero channel stays 0)
        flat = _flat_index(shape, (n, c, s))
        return compacted(acc(n, c, s), sh[c], key[0], flat, bits, stochastic, left_limit=0)

    return te.compute(shape, body, name="m")


def common_apply(
    shape: NCS, bits: int, stochastic: bool, name: str = "common_apply"
) -> tirx.PrimFunc:
    """m = clip(shift_signed(acc, sh_c), +-qmax) keyed by the flat index. Parameters
    (acc, sh, key, m)."""
    acc = te.placeholder(shape, I32, name="acc")
    sh = te.placeholder((shape[1],), I32, name="sh")
    key = te.placeholder((1,), I64, name="key")
    m = _common_apply(shape, lambda n, c, s: acc[n, c, s], sh, key, bits, stochastic)
    return _func([acc, sh, key, m], name)


@trial_cached()
def bn_affine_compaction(
    shape: NCS, bits: int, stochastic: bool, name: str = "bn_affine", agreed: int = 0
) -> tuple[tirx.PrimFunc, ...]:
    """The aligned sum of gamma * xhat (14 bits, key 0) and beta (7 bits, key 1, flat index c),
    compacted (site 4 of the caller) without storing it (te_compaction.fused_compaction):
    `<name>_shift` (xhat, e_xhat, gamma, e_g, beta, e_b, keys, s, e_out) and `<name>_apply`
    (the same inputs, s, key, m)."""
    inputs, target, value = _bn_affine_terms(shape, stochastic)
    return fused_compaction(shape, inputs, target, value, bits, stochastic, name, agreed)


def _bn_affine_terms(
    shape: NCS, stochastic: bool
) -> tuple[list[te.Tensor], te.Tensor, Callable[..., tirx.PrimExpr]]:
    """The affine sum's inputs, target exponent and element."""
    xhat = te.placeholder(shape, I8, name="xhat")
    e_x = te.placeholder((1,), I32, name="e_x")
    gamma = te.placeholder((shape[1],), I8, name="gamma")
    e_g = te.placeholder((1,), I32, name="e_g")
    beta = te.placeholder((shape[1],), I8, name="beta")
    e_b = te.placeholder((1,), I32, name="e_b")
    keys = te.placeholder((2,), I64, name="keys")
    target = te.compute(
        (1,), lambda _: aligned_target([(e_x[0] + e_g[0], 14), (e_b[0], 7)]), name="target"
    )

    # int32 lanes: the target is at least max(e + bits) - 29, so gamma * xhat (|.| <= 2^14)
    # shifts left by at most 15 bits and beta (<= 2^7) by at most 22: every term <= 2^29
    def body(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        p = xhat[n, c, s].astype(I32) * gamma[c].astype(I32)
        tp = target[0] - e_x[0] - e_g[0]
        tb = target[0] - e_b[0]
        a = shift_signed32(p, tp, keys[0], _flat_index(shape, (n, c, s)), stochastic, 15)
        b = shift_signed32(beta[c].astype(I32), tb, keys[1], c.astype(I64), stochastic, 22)
        return a + b

    return [xhat, e_x, gamma, e_g, beta, e_b, keys], target, body


# ----------------------------------------------------------------------------------- backward


@trial_cached()
def bn_grad_sums(
    shape: NCS, name: str = "bn_grad_sums", pre_shifted: bool = False
) -> tirx.PrimFunc:
    """dbeta = sum dy, dgamma = sum dy * xhat per channel (int32). Parameters
    (dy, xhat, dgamma, dbeta); with `pre_shifted` (dy, dp, xhat, dgamma, dbeta): dgamma from
    dp, dy pre-shifted for the M-wide product (site 7 of kernels.norm.batchnorm_backward)."""
    dy = te.placeholder(shape, I8, name="dy")
    dp = te.placeholder(shape, I8, name="dp") if pre_shifted else dy
    xh = te.placeholder(shape, I8, name="xh")
    db = _ncs_sum(shape, lambda n, c, s: dy[n, c, s].astype(I64), "db64")
    dg = _ncs_sum(shape, lambda n, c, s: dp[n, c, s].astype(I64) * xh[n, c, s].astype(I64), "dg64")
    dgamma = _per_channel(shape, lambda c: dg[c].astype(I32), "dgamma")
    dbeta = _per_channel(shape, lambda c: db[c].astype(I32), "dbeta")
    return _func([dy, *([dp] if pre_shifted else []), xh, dgamma, dbeta], name)


def to_bits_shift(shape: tuple[int, ...], limit_bits: int, name: str) -> tirx.PrimFunc:
    """numerics.compact_to_bits' shift: smallest s with max|x| <= 2^limit << s, e_out = e + s.
    Parameters (x int32, e (1,), s (1,), e_out (1,))."""
    x = te.placeholder(shape, I32, name="x")
    e = te.placeholder((1,), I32, name="e")
    s = fit_shift(abs_max_all(x, "amax"), 1 << limit_bits)
    e_out = te.compute((1,), lambda i: e[i] + s[i], name="e_out")
    return _func([x, e, s, e_out], name)


def shift_apply(shape: tuple[int, ...], stochastic: bool, name: str) -> tirx.PrimFunc:
    """y = shift_right(x, s) keyed by the flat index (int32 out; s >= 0, to_bits_shift's, so
    in int32 lanes). Parameters (x, s, key, y)."""
    x = te.placeholder(shape, I32, name="x")
    s = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), I64, name="key")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        return shift_right32(x[idx], s[0], key[0], _flat_index(shape, idx), stochastic)

    y = te.compute(shape, body, name="y")
    return _func([x, s, key, y], name)


def _bracket(
    shape: NCS, stochastic: bool, m: int | None = None
) -> tuple[list[te.Tensor], te.Tensor, Callable[..., tirx.PrimExpr]]:
    """The bracket's inputs (dy, e_dy, dbeta, xhat, e_xhat, dg16, e_dg16, keys), its target
    exponent (a (1,) tensor) and its element T(n, c, s) (int32). `m`: the whole batch's M
    (a data-parallel worker's shape holds its share; default N * S)."""
    m = m or shape[0] * shape[2]
    lg = ceil_log2(m)
    dy = te.placeholder(shape, I8, name="dy")
    e_dy = te.placeholder((1,), I32, name="e_dy")
    dbeta = te.placeholder((shape[1],), I32, name="dbeta")
    xh = te.placeholder(shape, I8, name="xh")
    e_xh = te.placeholder((1,), I32, name="e_xh")
    dg16 = te.placeholder((shape[1],), I32, name="dg16")
    e_dg = te.placeholder((1,), I32, name="e_dg")
    keys = te.placeholder((3,), I64, name="keys")
    e3 = e_xh[0] + e_dg[0]
    target = te.compute(
        (1,),
        lambda _: aligned_target([(e_dy[0], 7 + lg), (e_dy[0], 7 + lg), (e3, 22)]),
        name="target",
    )

    # int32 lanes where M allows: the target is at least max(e + bits) - 29, so M * dy and
    # dbeta (< 2^(7 + lg)) shift left by at most 22 - lg bits and xhat * dg16 (< 2^22) by at
    # most 7: every term < 2^29, their sum inside int32
    wide = 22 - lg < 0

    def body(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, (n, c, s))
        if wide:
            td = (target[0] - e_dy[0]).astype(I64)
            t3 = (target[0] - e3).astype(I64)
            a = shift_signed(dy[n, c, s].astype(I64) * m, td, keys[0], flat, stochastic)
            b = shift_signed(-dbeta[c].astype(I64), td, keys[1], c.astype(I64), stochastic)
            p = -(xh[n, c, s].astype(I64) * dg16[c].astype(I64))
            return (a + b + shift_signed(p, t3, keys[2], flat, stochastic)).astype(I32)
        td, t3 = target[0] - e_dy[0], target[0] - e3
        a = shift_signed32(dy[n, c, s].astype(I32) * m, td, keys[0], flat, stochastic, 22 - lg)
        b = shift_signed32(-dbeta[c], td, keys[1], c.astype(I64), stochastic, 22 - lg)
        p = -(xh[n, c, s].astype(I32) * dg16[c])
        return a + b + shift_signed32(p, t3, keys[2], flat, stochastic, 7)

    return [dy, e_dy, dbeta, xh, e_xh, dg16, e_dg, keys], target, body


def _rows_parallel(func: tirx.PrimFunc, block: str) -> tirx.PrimFunc:
    """`func` with the outer loop of sblock `block` in parallel."""
    sch = s_tir.Schedule(func)
    sch.parallel(sch.get_loops(sch.get_sblock(block))[0])
    return sch.mod["main"]


@trial_cached()
def bn_bracket(
    shape: NCS,
    stochastic: bool,
    name: str = "bn_bracket",
    row_max: bool = False,
    m: int | None = None,
) -> tirx.PrimFunc:
    """T = aligned sum of M*dy (key 0), -dbeta (key 1, flat index c) and -xhat * dg16 (key 2)
    (kernels.batchnorm_backward's bracket; magnitude bits 7 + ceil log2 M, the same, 22).
    Parameters (dy, e_dy, dbeta, xhat, e_xhat, dg16, e_dg16, keys, target, t), and with
    `row_max` a last one, amax (N, C): max |T| over s, computed as each row of T is written
    (host schedule), so that to_bits' shift reads (N, C) values instead of all of T."""
    inputs, target, body = _bracket(shape, stochastic, m)
    t = te.compute(shape, body, name="t")
    args = [*inputs, target, t]
    if not row_max:
        return _func(args, name)
    rs = te.reduce_axis((0, shape[2]), "rs")
    amax = te.compute(shape[:2], lambda n, c: te.max(iabs(t[n, c, rs]), axis=rs), name="amax")
    sch = s_tir.Schedule(_func([*args, amax], name))
    n_loop, c_loop, _ = sch.get_loops(sch.get_sblock("t"))
    sch.reverse_compute_at(sch.get_sblock("amax"), c_loop)  # the row is still in L1
    sch.parallel(n_loop)
    return sch.mod["main"]


def _row_cached(func: tirx.PrimFunc, row: str, reduce: str) -> tirx.PrimFunc:
    """`func` with block `row` (an (N, C, S) value computed for the (N, C) reduction block
    `reduce`) computed one (n, c) row at a time into a scratch row just before `reduce` reads
    it, n in parallel: the row's elements vectorize, where the value inside the reduction was
    scalar code (a host schedule)."""
    sch = s_tir.Schedule(func)
    n_loop, c_loop, _ = sch.get_loops(sch.get_sblock(reduce))
    sch.compute_at(sch.get_sblock(row), c_loop)
    sch.parallel(n_loop)
    return sch.mod["main"]


@trial_cached()
def bn_bracket_max(
    shape: NCS, stochastic: bool, name: str = "bn_bracket_max", cached_rows: bool = False
) -> tirx.PrimFunc:
    """The lean bracket's first pass: max |T| per (n, c) row and T's exponent, T computed and
    never stored. Parameters (the bracket's inputs, target, amax (N, C)). `cached_rows`: each
    row of T goes through a scratch row (`_row_cached`; host schedule)."""
    inputs, target, body = _bracket(shape, stochastic)
    rs = te.reduce_axis((0, shape[2]), "rs")
    if cached_rows:
        t = te.compute(shape, body, name="t")
        amax = te.compute(shape[:2], lambda n, c: te.max(iabs(t[n, c, rs]), axis=rs), name="amax")
        return _row_cached(_func([*inputs, target, amax], name), "t", "amax")
    amax = te.compute(shape[:2], lambda n, c: te.max(iabs(body(n, c, rs)), axis=rs), name="amax")
    return _rows_parallel(_func([*inputs, target, amax], name), "amax")


@trial_cached()
def bn_dx_unstored(
    shape: NCS,
    bits: int,
    stochastic: bool,
    name: str,
    cached_rows: bool = False,
    channels: bool = False,
) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """The lean batch-norm dx: dxa = shift_right(T, s) * f16_c (bn_dx_acc's element, T the
    bracket's, both recomputed) compacted along the channels (common_shift / common_apply, site
    key6) without storing T or dxa, bit for bit as bn_bracket, bn_dx_acc and common_compact.
    `<name>_shift` (bracket inputs, s, key4, e_bk, f16, e_f, e_grp, sh, e_out) and
    `<name>_apply` (bracket inputs, s, key4, f16, sh, key6, m). `cached_rows`: the shift's
    maxima read each row of dxa from a scratch row (`_row_cached`; host schedule). `channels`
    (channel exponents, te_channels): the first kernel gives the channel maxima instead,
    `<name>_amax` (bracket inputs, s, key4, e_bk, f16, e_f, e_grp, amax), for
    te_channels.channel_shift; the apply then rounds each channel by its shift (the frame's
    left shift follows: te_channels.channel_lift)."""
    inputs, target, body = _bracket(shape, stochastic)
    s_in = te.placeholder((1,), I32, name="s16")  # not "s": common_shift's own
    key4 = te.placeholder((1,), I64, name="key4")
    f16 = te.placeholder((shape[1],), I32, name="f16")

    def dxa(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, (n, c, s))
        return shift_right32(body(n, c, s), s_in[0], key4[0], flat, stochastic) * f16[c]

    e_bk = te.placeholder((1,), I32, name="e_bk")
    e_f = te.placeholder((shape[1],), I32, name="e_f")
    e_grp = te.compute((shape[1],), lambda c: e_bk[0] + e_f[c], name="e_grp")
    rows = te.compute(shape, dxa, name="dxa_row") if cached_rows else None
    acc = (lambda n, c, s: rows[n, c, s]) if rows is not None else dxa
    lead = [*inputs, s_in, key4]
    if channels:
        amax = channel_abs_max(shape, acc)
        shift = _func([*lead, e_bk, f16, e_f, e_grp, amax], f"{name}_amax")
    else:
        sh, e_out = _common_shift(shape, acc, e_grp, bits)
        shift = _func([*lead, e_bk, f16, e_f, e_grp, sh, e_out], f"{name}_shift")
    if cached_rows:
        shift = _row_cached(shift, "dxa_row", "amax_nc")
    sh_in = te.placeholder((shape[1],), I32, name="sh")
    key6 = te.placeholder((1,), I64, name="key6")
    m = _common_apply(shape, dxa, sh_in, key6, bits, stochastic)
    return shift, _func([*lead, f16, sh_in, key6, m], f"{name}_apply")


@trial_cached()
def bn_dx_factor(
    shape: NCS, stochastic: bool, name: str = "bn_dx_factor", m: int | None = None
) -> tirx.PrimFunc:
    """kernels.norm._dx_factor: fac = gamma * rstd, L = 30 - bitlen(fac),
    q = idiv_round(fac * 2^L, M), sf = max(bitlen(q) - 15, 0), f16 = round(q / 2^sf) (key,
    flat index c), e_f = e_g + rstd_e - L + sf. Parameters (gamma, e_g, rstd, rstd_e, key,
    f16, e_f). `m`: the whole batch's M (default N * S)."""
    m = m or shape[0] * shape[2]
    c_ = shape[1]
    gamma = te.placeholder((c_,), I8, name="gamma")
    e_g = te.placeholder((1,), I32, name="e_g")
    rstd = te.placeholder((c_,), I32, name="rstd")
    rstd_e = te.placeholder((c_,), I32, name="rstd_e")
    key = te.placeholder((1,), I64, name="key")
    fac = te.compute((c_,), lambda c: gamma[c].astype(I64) * rstd[c].astype(I64), name="fac")
    bl = _bitlen(fac, "bl_fac")
    q = te.compute(
        (c_,),
        lambda c: _div_const(fac[c] * (_c(1) << (_c(30) - bl[c].astype(I64))), m),
        name="q",
    )
    blq = _bitlen(q, "bl_q")
    sf = te.compute((c_,), lambda c: tirx.max(blq[c].astype(I64) - 15, _c(0)), name="sf")
    f16 = te.compute(
        (c_,),
        lambda c: shift_signed(q[c], sf[c], key[0], c.astype(I64), stochastic).astype(I32),
        name="f16",
    )
    e_f = te.compute(
        (c_,),
        lambda c: (
            e_g[0].astype(I64) + rstd_e[c].astype(I64) - (30 - bl[c].astype(I64)) + sf[c]
        ).astype(I32),
        name="e_f",
    )
    return _func([gamma, e_g, rstd, rstd_e, key, f16, e_f], name)


@trial_cached()
def bn_dx_acc(shape: NCS, stochastic: bool, name: str = "bn_dx_acc") -> tirx.PrimFunc:
    """dxa = bk16 * f16_c (int32) with bk16 = shift_right(t, s) (to_bits' apply, keyed by the
    flat index, done here instead of through an int32 buffer), e_grp = e_bk + e_f_c.
    Parameters (t, s, key, e_bk, f16, e_f, dxa, e_grp)."""
    t = te.placeholder(shape, I32, name="t")
    s_in = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), I64, name="key")
    e_bk = te.placeholder((1,), I32, name="e_bk")
    f16 = te.placeholder((shape[1],), I32, name="f16")
    e_f = te.placeholder((shape[1],), I32, name="e_f")

    def body(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, (n, c, s))
        return shift_right32(t[n, c, s], s_in[0], key[0], flat, stochastic) * f16[c]

    dxa = te.compute(shape, body, name="dxa")
    e_grp = te.compute((shape[1],), lambda c: e_bk[0] + e_f[c], name="e_grp")
    return _func([t, s_in, key, e_bk, f16, e_f, dxa, e_grp], name)


# ----------------------------------------------------------------------------------- running


@trial_cached()
def bn_ema(
    channels: int, per_channel_b: bool, momentum: FixedScalar, stochastic: bool, name: str
) -> tirx.PrimFunc:
    """kernels.norm._ema's aligned sum: (2^shift - num) * r at r_e - shift and num * b16 at
    e_b + s - shift (b16 = b compacted to 16 bits by s), keys 0 / 1, flat index c, per channel
    target. Parameters (r, r_e, b16, e_b, s, keys, target, acc); e_b has C elements when
    per_channel_b (the variance) else one (the mean)."""
    one_minus = (1 << momentum.shift) - momentum.num
    r = te.placeholder((channels,), I8, name="r")
    r_e = te.placeholder((channels,), I32, name="r_e")
    b16 = te.placeholder((channels,), I32, name="b16")
    e_b = te.placeholder((channels if per_channel_b else 1,), I32, name="e_b")
    s = te.placeholder((1,), I32, name="s")
    keys = te.placeholder((2,), I64, name="keys")

    def e1(c: tirx.PrimExpr) -> tirx.PrimExpr:
        return r_e[c] - momentum.shift

    def e2(c: tirx.PrimExpr) -> tirx.PrimExpr:
        return e_b[c if per_channel_b else 0] + s[0] - momentum.shift

    b1, b2 = 7 + one_minus.bit_length(), 15 + momentum.num.bit_length()
    target = te.compute(
        (channels,), lambda c: aligned_target([(e1(c), b1), (e2(c), b2)]), name="target"
    )

    def body(c: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = c.astype(I64)
        a = shift_signed(
            r[c].astype(I64) * one_minus, (target[c] - e1(c)).astype(I64), keys[0], flat, stochastic
        )
        b = shift_signed(
            b16[c].astype(I64) * momentum.num,
            (target[c] - e2(c)).astype(I64),
            keys[1],
            flat,
            stochastic,
        )
        return (a + b).astype(I32)

    acc = te.compute((channels,), body, name="acc")
    return _func([r, r_e, b16, e_b, s, keys, target, acc], name)


# ----------------------------------------------------------------------------------- evaluation


def bn_eval_center(
    shape: NCS,
    c_rm: int,
    c_rv: int,
    eps: FixedScalar,
    name: str = "bn_eval_center",
    native_division: bool = False,
) -> tirx.PrimFunc:
    """kernels.norm.batchnorm_forward_eval up to its xhat accumulator, rounding to nearest (the
    inference path's rounding: no keys). Per channel target t_c of
    aligned_sum([(x, ex, 7), (-rm_c, e_rm_c, 7)]) and xc = the aligned sum (sites 0, 1);
    sx_c = max(bitlen(max |xc|) - 15, 0) over the channel's (n, s); xc16 = shift_right(xc, sx_c)
    (site 2); rstd, rstd_e from (rv, e_rv) (kernels.norm._rstd: `_rstd_stages`);
    e_grp = t_c + sx_c + rstd_e_c, the exponent of xc16 * rstd in channel c.
    Parameters (x, ex, rm, e_rm, rv, e_rv, xc16, rstd, e_grp); e_rm, e_rv hold one exponent per
    channel (c_rm = C) or one for all (c_rm = 1)."""
    c = shape[1]
    x = te.placeholder(shape, I8, name="x")
    ex = te.placeholder((1,), I32, name="ex")
    rm = te.placeholder((c,), I8, name="rm")
    e_rm = te.placeholder((c_rm,), I32, name="e_rm")
    rv = te.placeholder((c,), I8, name="rv")
    e_rv = te.placeholder((c_rv,), I32, name="e_rv")
    zero = _c(0)

    def erm(ch: tirx.PrimExpr) -> tirx.PrimExpr:
        return e_rm[ch if c_rm > 1 else 0].astype(I64)

    tgt = _per_channel(
        shape, lambda ch: aligned_target([(ex[0].astype(I64), 7), (erm(ch), 7)]), "tgt"
    )

    def xc(n: tirx.PrimExpr, ch: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        a = shift_signed(x[n, ch, s].astype(I64), tgt[ch] - ex[0].astype(I64), zero, zero, False)
        b = shift_signed(-rm[ch].astype(I64), tgt[ch] - erm(ch), zero, zero, False)
        return a + b

    rs = te.reduce_axis((0, shape[2]), "xs")
    part = te.compute(
        shape[:2], lambda n, ch: te.max(iabs(xc(n, ch, rs)), axis=rs), name="xc_amax_nc"
    )
    rn = te.reduce_axis((0, shape[0]), "xn")
    amax = _per_channel(shape, lambda ch: te.max(part[rn, ch], axis=rn), "xc_amax")
    bl = _bitlen(amax, "bl_xc")
    sx = _per_channel(shape, lambda ch: tirx.max(bl[ch].astype(I64) - 15, zero), "sx")
    xc16 = te.compute(
        shape,
        lambda n, ch, s: shift_signed(xc(n, ch, s), sx[ch], zero, zero, False).astype(I32),
        name="xc16",
    )
    var_m = _per_channel(shape, lambda ch: rv[ch].astype(I64), "var_m")
    ev = _per_channel(shape, lambda ch: e_rv[ch if c_rv > 1 else 0].astype(I64), "ev")
    rstd, rstd_e = _rstd_stages(var_m, ev, eps, native_division)
    e_grp = _per_channel(shape, lambda ch: (tgt[ch] + sx[ch] + rstd_e[ch]).astype(I32), "e_grp")
    return _func([x, ex, rm, e_rm, rv, e_rv, xc16, _to_i32(rstd), e_grp], name)


def _eval_xhat_inputs(shape: NCS) -> tuple[list[te.Tensor], Callable[..., tirx.PrimExpr]]:
    """(xc16, rstd) and the eval xhat accumulator xc16 * rstd (|.| <= 2^30), computed where it
    is read."""
    xc16 = te.placeholder(shape, I32, name="xc16")
    rstd = te.placeholder((shape[1],), I32, name="rstd")
    return [xc16, rstd], lambda n, c, s: xc16[n, c, s] * rstd[c]


def bn_eval_xhat_shift(shape: NCS, bits: int, name: str = "bn_eval_xhat_shift") -> tirx.PrimFunc:
    """common_shift of the eval xhat accumulator. Parameters (xc16, rstd, e_grp, sh, e_out)."""
    inputs, acc = _eval_xhat_inputs(shape)
    e_grp = te.placeholder((shape[1],), I32, name="e_grp")
    sh, e_out = _common_shift(shape, acc, e_grp, bits)
    return _func([*inputs, e_grp, sh, e_out], name)


def bn_eval_xhat_max(shape: NCS, name: str = "bn_eval_xhat_max") -> tirx.PrimFunc:
    """max |eval xhat accumulator| per channel (channel exponents' shifts).
    Parameters (xc16, rstd, amax)."""
    inputs, acc = _eval_xhat_inputs(shape)
    return _func([*inputs, channel_abs_max(shape, acc)], name)


def bn_eval_xhat_apply(shape: NCS, bits: int, name: str = "bn_eval_xhat_apply") -> tirx.PrimFunc:
    """common_apply of the eval xhat accumulator, nearest (site 3). Parameters
    (xc16, rstd, sh, key, m)."""
    inputs, acc = _eval_xhat_inputs(shape)
    sh = te.placeholder((shape[1],), I32, name="sh")
    key = te.placeholder((1,), I64, name="key")
    m = _common_apply(shape, acc, sh, key, bits, False)
    return _func([*inputs, sh, key, m], name)
