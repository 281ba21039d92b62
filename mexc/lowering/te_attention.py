"""Attention and LayerNorm kernels of the training step as TVM tensor expressions (target
independent): the operand transpose of the batched matmul's weight-side gradient, the row
softmax and its gradient, LayerNorm's row statistics, normalization and gradient. Each is the
arithmetic of mexc/kernels/transformer.py element for element (rounding keys: the C-order flat
index of the array the reference rounds)."""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx

from mexc.kernels.transformer import KEY_CMPS, SOFTMAX_RECIP_LOG2
from mexc.lowering.te_compaction import (
    _flat_index,
    aligned_target,
    fit_shift,
    fused_compaction,
    shift_right32,
    shift_signed,
    shift_signed32,
    unstored_abs_max,
    where,
)
from mexc.lowering.te_divide import idiv_round
from mexc.lowering.te_func import a_row_at_a_time, prim_func
from mexc.lowering.te_ops import exp_lookup
from mexc.lowering.te_pool import div_const
from mexc.numerics import Reciprocal, ceil_log2, qmax

I8, I32, I64 = "int8", "int32", "int64"


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


def transposed_pre_shift(
    shape: tuple[int, int, int], shift: int, stochastic: bool, name: str
) -> tirx.PrimFunc:
    """kernels._common.fit_product on swapaxes(a, -1, -2): a (B, M, K) int8 in, out (B, K, M)
    int8 = shift_right(a[b, m, k], shift), rounding keyed by the flat index of (B, K, M) (the
    transposed array the reference rounds). Parameters (a, key, out)."""
    bt, m, k = shape
    a = te.placeholder(shape, I8, name="a")
    key = te.placeholder((1,), I64, name="key")
    sh = tirx.const(shift, I32)
    out_shape = (bt, k, m)

    def body(b: tirx.PrimExpr, j: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(out_shape, (b, j, i))
        return shift_right32(a[b, i, j].astype(I32), sh, key[0], flat, stochastic).astype(I8)

    return _func([a, key, te.compute(out_shape, body, name="out")], name)


# ----------------------------------------------------------------------------------- softmax


def softmax_forward(
    rows: int,
    k: int,
    bits: int,
    stochastic: bool,
    name: str,
    native_division: bool = False,
    host_schedule: bool = False,
    causal_q: int = 0,
    key_mask: tuple[str, int, int] | None = None,
) -> tirx.PrimFunc:
    """kernels.softmax_forward on (rows, K): d = m - rowmax; E = EXP_TABLE[clamp(shift(d,
    EXP_IN_EXP - e_x)) + 128] (a right shift rounded with keys[0], a left shift saturating);
    S = row sum; R = idiv_round(2^30, S); p = min(shift_right(E R, 30 - (B - 1)) (keys[1]),
    qmax(B)) at the fixed exponent -(B - 1). Flat index r K + j for both sites. Parameters
    (x, e, keys, table, p): keys int64[2], table int32[256] (numerics.EXP_TABLE).
    `host_schedule`: a row at a time (te_func.a_row_at_a_time; 9408 x 49, 2-core Zen 3,
    2026-12-02: 0.65 ms a block at a time, 0.35 ms a row at a time). `causal_q` > 0: rows of
    that many queries, row r's keys j > r % causal_q hidden (kernels.softmax_forward(causal=
    True): out of the row max, E = 0). `key_mask` (cmp, value, samples): an ids parameter
    int32 (samples, K) before p, and row r's key j hidden also where ids[r // (rows /
    samples), j] cmp value; a row with every key hidden gets R = 0 (p = 0)."""
    x = te.placeholder((rows, k), I8, name="x")
    e = te.placeholder((1,), I32, name="e")
    keys = te.placeholder((2,), I64, name="keys")
    table = te.placeholder((256,), I32, name="table")
    ids = None
    if key_mask is not None:
        cmp, value, samples = key_mask
        ids = te.placeholder((samples, k), I32, name="ids")
        per = rows // samples
    rj = te.reduce_axis((0, k), "rj")

    def hidden(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr | None:
        causal = j > r % causal_q if causal_q else None
        if ids is None:
            return causal
        masked = KEY_CMPS[cmp](ids[r // per, j], tirx.const(value, I32))
        return masked if causal is None else tirx.Or(causal, masked)

    def seen(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        h = hidden(r, j)
        return x[r, j] if h is None else where(h, tirx.const(-128, I8), x[r, j])

    rowmax = te.compute((rows,), lambda r: te.max(seen(r, rj), axis=rj), name="rowmax")

    def lookup(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        v = exp_lookup(x, rowmax, e, keys[0], table, stochastic, r, j)
        h = hidden(r, j)
        return v if h is None else where(h, tirx.const(0, v.dtype), v)

    ex = te.compute((rows, k), lookup, name="ex")
    rs = te.reduce_axis((0, k), "rs")
    srow = te.compute((rows,), lambda r: te.sum(ex[r, rs], axis=rs), name="srow")
    one = tirx.const(1 << SOFTMAX_RECIP_LOG2, I64)

    def reciprocal(r: tirx.PrimExpr) -> tirx.PrimExpr:
        if ids is None:  # S >= E(0) = 2^15: each row keeps a key
            return idiv_round(one, srow[r], native_division).astype(I32)
        s = srow[r]
        v = idiv_round(one, tirx.max(s, tirx.const(1, s.dtype)), native_division).astype(I32)
        return where(s == 0, tirx.const(0, I32), v)

    recip = te.compute((rows,), reciprocal, name="recip")
    shift = tirx.const(SOFTMAX_RECIP_LOG2 - (bits - 1), I32)

    def prob(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = r.astype(I64) * k + j.astype(I64)
        v = shift_right32(ex[r, j] * recip[r], shift, keys[1], flat, stochastic)  # E R <= 2^30
        return tirx.min(v, qmax(bits)).astype(I8)

    p = te.compute((rows, k), prob, name="p")
    params = [x, e, keys, table, *([ids] if ids is not None else []), p]
    func = _func(params, name)
    return a_row_at_a_time(func, "p") if host_schedule else func


def softmax_grad_rows(
    rows: int, k: int, acc_bits: int, stochastic: bool, name: str
) -> tirx.PrimFunc:
    """kernels.softmax_backward's row term: s_r = sum_j dm p (dm: dy, pre-shifted for the
    K-wide product, at e_s = e_dm + e_p), target = aligned_target([(e_dy, 7), (e_s,
    acc_bits)]) and srow = shift(-s_r, target - e_s) (keys[1], flat index r: the (rows, 1)
    term of the aligned sum t). Parameters (e_dy, dm, e_dm, p, e_p, keys, target, srow):
    target int32[1], srow int64 (rows,)."""
    e_dy = te.placeholder((1,), I32, name="e_dy")
    dm = te.placeholder((rows, k), I8, name="dm")
    e_dm = te.placeholder((1,), I32, name="e_dm")
    p = te.placeholder((rows, k), I8, name="p")
    e_p = te.placeholder((1,), I32, name="e_p")
    keys = te.placeholder((2,), I64, name="keys")
    rj = te.reduce_axis((0, k), "rj")
    s_r = te.compute(
        (rows,),
        lambda r: te.sum(dm[r, rj].astype(I32) * p[r, rj].astype(I32), axis=rj),
        name="s_r",
    )
    target = te.compute(
        (1,), lambda _: aligned_target([(e_dy[0], 7), (e_dm[0] + e_p[0], acc_bits)]), "target"
    )
    srow = te.compute(
        (rows,),
        lambda r: shift_signed(
            -s_r[r].astype(I64),
            (target[0] - e_dm[0] - e_p[0]).astype(I64),
            keys[1],
            r.astype(I64),
            stochastic,
        ),
        name="srow",
    )
    return _func([e_dy, dm, e_dm, p, e_p, keys, target, srow], name)


T16_BITS = 15  # kernels.softmax_backward: t16 = compact_to_bits(t, 15)


def _t_inputs(rows: int, k: int) -> list[te.Tensor]:
    """The inputs t is computed from: (dy, e_dy, keys, target, srow: softmax_grad_rows')."""
    return [
        te.placeholder((rows, k), I8, name="dy"),
        te.placeholder((1,), I32, name="e_dy"),
        te.placeholder((2,), I64, name="keys"),
        te.placeholder((1,), I32, name="target"),
        te.placeholder((rows,), I64, name="srow"),
    ]


def _t(inputs: list[te.Tensor], k: int, stochastic: bool) -> Callable[..., tirx.PrimExpr]:
    """t(r, j) = shift(dy, target - e_dy) (keys[0], flat index r K + j) + srow[r], int32: the
    aligned sum of kernels.softmax_backward, from _t_inputs."""
    dy, e_dy, keys, target, srow = inputs

    def t(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = r.astype(I64) * k + j.astype(I64)
        shift = (target[0] - e_dy[0]).astype(I64)
        a = shift_signed(dy[r, j].astype(I64), shift, keys[0], flat, stochastic)
        return (a + srow[r]).astype(I32)

    return t


def softmax_grad_t16(
    rows: int, k: int, stochastic: bool, name: str, agreed: int = 0
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.softmax_backward's t16 = compact_to_bits(t, 15) (rounding site 3) of the
    aligned sum t (_t), which is never stored: `<name>_shift` computes every t for max |t|
    (inputs -> s, e16 = target + s), `<name>_apply` each again and shifts it (inputs, s, key
    -> t16 int32). Inputs _t_inputs. `agreed`: a data-parallel worker's form, whose maximum is
    agreed between `<name>_amax` (inputs -> a slot of `agreed` int32) and the shift (inputs,
    slot -> s, e16)."""
    shape = (rows, k)
    inputs = _t_inputs(rows, k)
    t, target = _t(inputs, k, stochastic), inputs[3]
    scan, slot_in, amax = unstored_abs_max(shape, inputs, t, name, agreed)
    s = fit_shift(amax, 1 << T16_BITS)
    e16 = te.compute((1,), lambda g: target[0] + s[g], name="e16")
    shift = prim_func([*inputs, *slot_in, s, e16], f"{name}_shift")
    s_in = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), I64, name="key")

    def body(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = r.astype(I64) * k + j.astype(I64)
        return shift_right32(t(r, j), s_in[0], key[0], flat, stochastic)

    t16 = te.compute(shape, body, name="t16")
    return (*scan, shift, prim_func([*inputs, s_in, key, t16], f"{name}_apply"))


def softmax_grad_product(
    rows: int,
    k: int,
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
    recompute: bool = False,
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.softmax_backward's dx: the compaction (te_compaction.fused_compaction) of
    p * t16 (|.| <= 2^22) at e_p + e16, never stored. Inputs (p, e_p, t16, e16); `recompute`
    (a lean form without the int32 t16): (p, e_p, *_t_inputs, s16, key3, e16), each t16
    computed again from t as softmax_grad_t16's apply does (shift s16, rounding key3)."""
    shape = (rows, k)
    p = te.placeholder(shape, I8, name="p")
    e_p = te.placeholder((1,), I32, name="e_p")
    e16 = te.placeholder((1,), I32, name="e16")
    target = te.compute((1,), lambda _: e_p[0] + e16[0], name="e_prod")  # not _t_inputs' target
    if recompute:
        t_inputs = _t_inputs(rows, k)
        t = _t(t_inputs, k, stochastic)
        s16 = te.placeholder((1,), I32, name="s16")
        key3 = te.placeholder((1,), I64, name="key3")
        inputs = [p, e_p, *t_inputs, s16, key3, e16]

        def t16(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
            flat = r.astype(I64) * k + j.astype(I64)
            return shift_right32(t(r, j), s16[0], key3[0], flat, stochastic)

    else:
        stored = te.placeholder(shape, I32, name="t16")
        inputs = [p, e_p, stored, e16]

        def t16(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
            return stored[r, j]

    def value(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        return p[r, j].astype(I32) * t16(r, j)

    return fused_compaction(shape, inputs, target, value, bits, stochastic, name, agreed)


# --------------------------------------------------------------------------------- LayerNorm
# The statistics, 1/sigma and xhat are te_norm's batch-norm kernels on x seen as (1, R, D): the
# "channels" are the rows, each reduced over its D elements, and the flat index of (1, R, D) is
# that of (R, D). What differs is below: gamma and beta run along D (the reduction axis).

LN_MAG = 7  # int8 mantissa magnitude bits (kernels._common.MAG)


def affine_channel(
    r: tirx.PrimExpr, j: tirx.PrimExpr, d: int, groups: int, per: int
) -> tirx.PrimExpr:
    """kernels.transformer.affine_channels: the parameter index of element (r, j) of the (R, D)
    rows: j for LayerNorm, the channel (r mod G) C/G + j // P for GroupNorm."""
    if groups == 1 and per == 1:
        return j
    return (r % groups) * (d // per) + j // per


def ln_affine_compaction(
    rows: int,
    d: int,
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
    groups: int = 1,
    per: int = 1,
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.layernorm_forward's affine: aligned_sum of xhat * gamma[d] (14 bits, key 0, flat
    index r D + d) and beta[d] (7 bits, key 1, flat index d: the (1, D) term), compacted without
    being stored (te_compaction.fused_compaction): `<name>_shift` (xhat, e_x, gamma, e_g, beta,
    e_b, keys, s, e_out) and `<name>_apply` (the same inputs, s, key, m). GroupNorm (groups,
    per): gamma and beta per channel (affine_channel), beta's flat index the channel."""
    shape = (rows, d)
    params = (groups * (d // per),)
    xhat = te.placeholder(shape, I8, name="xhat")
    e_x = te.placeholder((1,), I32, name="e_x")
    gamma = te.placeholder(params, I8, name="gamma")
    e_g = te.placeholder((1,), I32, name="e_g")
    beta = te.placeholder(params, I8, name="beta")
    e_b = te.placeholder((1,), I32, name="e_b")
    keys = te.placeholder((2,), I64, name="keys")
    target = te.compute(
        (1,), lambda _: aligned_target([(e_x[0] + e_g[0], 14), (e_b[0], 7)]), name="target"
    )

    # int32 lanes, as te_norm's batch-norm affine: every term stays below 2^29
    def body(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        c = affine_channel(r, j, d, groups, per)
        p = xhat[r, j].astype(I32) * gamma[c].astype(I32)
        tp = target[0] - e_x[0] - e_g[0]
        tb = target[0] - e_b[0]
        a = shift_signed32(p, tp, keys[0], _flat_index(shape, (r, j)), stochastic, 15)
        b = shift_signed32(beta[c].astype(I32), tb, keys[1], c.astype(I64), stochastic, 22)
        return a + b

    inputs = [xhat, e_x, gamma, e_g, beta, e_b, keys]
    return fused_compaction(shape, inputs, target, body, bits, stochastic, name, agreed)


def ln_param_grads(
    rows: int, d: int, pre_shifted: bool, name: str, groups: int = 1, per: int = 1
) -> tirx.PrimFunc:
    """kernels.layernorm_backward step 1: dbeta[d] = sum_r dy, dgamma[d] = sum_r dp xhat (dp:
    dy, or dy pre-shifted for the R-wide product), int32 column sums (the caps bound every
    partial sum). Parameters (dy, [dp,] xhat, dgamma, dbeta). GroupNorm (groups, per): the sums
    per channel, over the samples and the channel's P elements (channel_sums)."""
    shape = (rows, d)
    dy = te.placeholder(shape, I8, name="dy")
    dp = te.placeholder(shape, I8, name="dp") if pre_shifted else dy
    xhat = te.placeholder(shape, I8, name="xhat")
    if groups != 1 or per != 1:
        return _channel_param_grads(dy, dp, xhat, pre_shifted, groups, per, name)
    rb = te.reduce_axis((0, rows), "rb")
    dbeta = te.compute((d,), lambda j: te.sum(dy[rb, j].astype(I32), axis=rb), name="dbeta")
    rg = te.reduce_axis((0, rows), "rg")
    dgamma = te.compute(
        (d,),
        lambda j: te.sum(dp[rg, j].astype(I32) * xhat[rg, j].astype(I32), axis=rg),
        name="dgamma",
    )
    return _func([dy, *([dp] if pre_shifted else []), xhat, dgamma, dbeta], name)


def _channel_param_grads(
    dy: te.Tensor,
    dp: te.Tensor,
    xhat: te.Tensor,
    pre_shifted: bool,
    groups: int,
    per: int,
    name: str,
) -> tirx.PrimFunc:
    """ln_param_grads for GroupNorm: channel c = g C/G + k sums rows n G + g, columns k P + p."""
    rows, d = (int(v) for v in dy.shape)
    cg = d // per
    samples = rows // groups

    def at(t: te.Tensor, c: tirx.PrimExpr, s: tirx.PrimExpr, q: tirx.PrimExpr) -> tirx.PrimExpr:
        return t[s * groups + c // cg, (c % cg) * per + q].astype(I32)

    sb, qb = te.reduce_axis((0, samples), "sb"), te.reduce_axis((0, per), "qb")
    params = (groups * cg,)
    dbeta = te.compute(params, lambda c: te.sum(at(dy, c, sb, qb), axis=[sb, qb]), name="dbeta")
    sg, qg = te.reduce_axis((0, samples), "sg"), te.reduce_axis((0, per), "qg")
    dgamma = te.compute(
        params,
        lambda c: te.sum(at(dp, c, sg, qg) * at(xhat, c, sg, qg), axis=[sg, qg]),
        name="dgamma",
    )
    return _func([dy, *([dp] if pre_shifted else []), xhat, dgamma, dbeta], name)


def ln_grad_pre(d: int) -> int:
    """kernels.layernorm_backward's static pre-shift of g = dy gamma (site 5): the excess of
    21 + ceil log2 D over 31 bits (0: none)."""
    return max(2 * LN_MAG + LN_MAG + ceil_log2(d) - 31, 0)


def ln_grad_g(
    rows: int, d: int, stochastic: bool, name: str, groups: int = 1, per: int = 1
) -> tirx.PrimFunc:
    """kernels.layernorm_backward steps 2-3 before sgx's compaction: g = dy gamma[d]
    (pre-shifted by ln_grad_pre(D) with key, flat index r D + d) at e_g = e_dy + e_gamma (+ the
    pre-shift); sg_r = sum_d g, sgx_r = sum_d g xhat. Parameters (dy, e_dy, gamma, e_gamma,
    xhat, key, g, e_g, sg, sgx): g int32 (R, D), sg and sgx int32 (R,)."""
    shape = (rows, d)
    pre = ln_grad_pre(d)
    dy = te.placeholder(shape, I8, name="dy")
    e_dy = te.placeholder((1,), I32, name="e_dy")
    gamma = te.placeholder((groups * (d // per),), I8, name="gamma")
    e_gamma = te.placeholder((1,), I32, name="e_gamma")
    xhat = te.placeholder(shape, I8, name="xhat")
    key = te.placeholder((1,), I64, name="key")

    def g_body(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        c = affine_channel(r, j, d, groups, per)
        v = dy[r, j].astype(I32) * gamma[c].astype(I32)  # |.| < 2^14
        if pre == 0:
            return v
        flat = _flat_index(shape, (r, j))
        return shift_right32(v, tirx.const(pre, I32), key[0], flat, stochastic)

    g = te.compute(shape, g_body, name="g")
    e_g = te.compute((1,), lambda i: e_dy[i] + e_gamma[i] + pre, name="e_g")
    rj = te.reduce_axis((0, d), "rj")
    sg = te.compute((rows,), lambda r: te.sum(g[r, rj], axis=rj), name="sg")
    rk = te.reduce_axis((0, d), "rk")
    sgx = te.compute(
        (rows,), lambda r: te.sum(g[r, rk] * xhat[r, rk].astype(I32), axis=rk), name="sgx"
    )
    return _func([dy, e_dy, gamma, e_gamma, xhat, key, g, e_g, sg, sgx], name)


def ln_grad_bracket(rows: int, d: int, stochastic: bool, name: str) -> tirx.PrimFunc:
    """kernels.layernorm_backward step 4: T = aligned_sum([(D g, e_g, 14 + lg), (-sg_r, e_g,
    14 + lg), (-(xhat sgx16_r), e_xhat + e_sgx16, 22)]) with keys 0, 1, 2 (flat index r D + d,
    r for the (R, 1) term, r D + d). Parameters (g, e_g, sg, xhat, e_xhat, sgx16, e_sgx16,
    keys, target, t)."""
    shape = (rows, d)
    lg = ceil_log2(d)
    g = te.placeholder(shape, I32, name="g")
    e_g = te.placeholder((1,), I32, name="e_g")
    sg = te.placeholder((rows,), I32, name="sg")
    xhat = te.placeholder(shape, I8, name="xhat")
    e_xhat = te.placeholder((1,), I32, name="e_xhat")
    sgx16 = te.placeholder((rows,), I32, name="sgx16")
    e_sgx16 = te.placeholder((1,), I32, name="e_sgx16")
    keys = te.placeholder((3,), I64, name="keys")
    e_x = e_xhat[0] + e_sgx16[0]
    top = 2 * LN_MAG + lg
    target = te.compute(
        (1,), lambda _: aligned_target([(e_g[0], top), (e_g[0], top), (e_x, 22)]), "target"
    )
    t_g = (target[0] - e_g[0]).astype(I64)
    sg_aligned = te.compute(
        (rows,),
        lambda r: shift_signed(-sg[r].astype(I64), t_g, keys[1], r.astype(I64), stochastic),
        name="sg_aligned",
    )

    def body(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, (r, j))
        a = shift_signed(g[r, j].astype(I64) * d, t_g, keys[0], flat, stochastic)
        px = -(xhat[r, j].astype(I64) * sgx16[r].astype(I64))
        c = shift_signed(px, (target[0] - e_x).astype(I64), keys[2], flat, stochastic)
        return (a + sg_aligned[r] + c).astype(I32)

    t = te.compute(shape, body, name="t")
    return _func([g, e_g, sg, xhat, e_xhat, sgx16, e_sgx16, keys, target, t], name)


def ln_dx_acc(rows: int, d: int, name: str) -> tirx.PrimFunc:
    """kernels.layernorm_backward steps 5-6 after T's compaction to 16 bits: Bk = div_const(T16,
    Reciprocal.of(D)) at e_t16 - pow2, dx_acc = Bk rstd_r (<= 2^30) at e_grp_r = e_t16 - pow2 +
    rstd_e_r. Parameters (t16, e_t16, rstd, rstd_e, acc, e_grp)."""
    shape = (rows, d)
    recip = Reciprocal.of(d)
    t16 = te.placeholder(shape, I32, name="t16")
    e_t16 = te.placeholder((1,), I32, name="e_t16")
    rstd = te.placeholder((rows,), I32, name="rstd")
    rstd_e = te.placeholder((rows,), I32, name="rstd_e")

    def body(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        bk = div_const(t16[r, j].astype(I64), recip).astype(I32)
        return bk * rstd[r]

    acc = te.compute(shape, body, name="acc")
    e_grp = te.compute((rows,), lambda r: e_t16[0] - recip.pow2 + rstd_e[r], name="e_grp")
    return _func([t16, e_t16, rstd, rstd_e, acc, e_grp], name)
