"""Batch normalization (training, running statistics, evaluation, backward), integer only.

Input (N, C, H, W) or (N, C); statistics per channel C over M = N*H*W elements.
See docs/layers.md for the recipe and the rounding sites.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mexc.kernels._common import (
    MAG,
    RoundBlocks,
    aligned_sum_fast,
    bit_length,
    block_rows,
    channels_on,
    common_shifts,
    compact_common,
    compact_mx,
    debug_on,
    fast_compact_to_bits,
    fast_shift_right,
    fit_product,
    global_rows,
    i64,
    round_shift_blocked,
    row_offset,
    scalar_exp,
    site_key,
)
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import (
    FixedScalar,
    ceil_log2,
    check_int32,
    compact,
    compaction_shift,
    idiv_round,
    isqrt,
    product_cap,
    shift_left,
    shift_signed,
    sum_cap,
)

MEAN_FRAC_BITS = 8  # at most 8 fractional bits below the input exponent for the mean
RSTD_NUM_LOG2 = 29  # rstd = round(2^29 / sigma), sigma in [2^14, 2^15] -> rstd in [2^14, 2^15]
EPS_BITS = 30  # the aligned eps stays below 2^EPS_BITS (docs/layers.md, BatchNorm step 4)


@dataclass(frozen=True)
class BatchNormSaved:
    """What batchnorm_backward (and the running-statistics update) needs.

    xhat: normalized input, int8 mantissas, per-tensor exponent.
    rstd / rstd_e: per-channel integer 1/sigma (in [2^14, 2^15]) and its per-channel exponent.
    gamma: the scale parameter used in the forward.
    mean: batch mean (C,), one exponent. var / var_unbiased: batch variance (C,), per-channel
    exponents (biased, and times M/(M-1) for the running statistics as torch does).
    count: M.
    """

    xhat: MX
    rstd: np.ndarray
    rstd_e: np.ndarray
    gamma: MX
    mean: Acc
    var: Acc
    var_unbiased: Acc
    count: int


def _as_ncs(m: np.ndarray) -> np.ndarray:
    if m.ndim == 2:
        return i64(m)[:, :, None]
    if m.ndim == 4:
        n, c, h, w = m.shape
        return i64(m).reshape(n, c, h * w)
    raise ValueError(f"batchnorm needs (N, C) or (N, C, H, W) input, got {m.shape}")


def _eps_fixed(eps: float | FixedScalar) -> FixedScalar:
    return eps if isinstance(eps, FixedScalar) else FixedScalar.of(float(eps))


def mean_frac_bits(m: int) -> int:
    """f = min(8, sum_cap(M, 8)): fractional bits of the mean; S << f fits int32."""
    f = min(MEAN_FRAC_BITS, sum_cap(m, 8))
    if f < 0:
        raise ValueError(f"batchnorm reduction of {m} elements exceeds the int32 sum cap")
    return f


def _rstd(var_m: np.ndarray, ev: np.ndarray, eps: FixedScalar) -> tuple[np.ndarray, np.ndarray]:
    """Per channel 1/sqrt(var * 2^ev + eps) as (rstd in [2^14, 2^15], exponent); var_m <= 2^30.

    var + eps is summed at ev' = ev + k with k = eps_rise(sh) (sh = -eps.shift - ev), so the
    aligned eps num << (sh - k) is exact and below 2^30 (or a nearest right shift if sh < 0),
    and var is rounded to nearest by k. n0 = max(var + eps, 1) is normalized by
    t = 29 - bitlen(n0) (+1 if ev' - t is odd) so n = n0 * 2^t lies in [2^28, 2^30] with an
    even exponent (nearest rounding if t < 0); sigma = isqrt(n) in [2^14, 2^15], exponent
    (ev' - t) / 2; rstd = idiv_round(2^29, sigma), exponent -29 - (ev' - t) / 2.
    """
    ev = i64(ev)
    sh = -eps.shift - ev
    k = eps_rise(eps, sh)
    ev = ev + k
    num = np.full(ev.shape, eps.num, np.int64)
    left = num << np.maximum(sh - k, 0)
    right = fast_shift_right(num, np.maximum(-sh, 0), "nearest")
    var_a = fast_shift_right(i64(var_m), k, "nearest")
    n0 = np.maximum(var_a + np.where(sh >= 0, left, right), 1)
    check_int32(n0, "batchnorm_var")
    t = 29 - bit_length(n0)
    t = np.where((ev - t) % 2 != 0, t + 1, t)
    n = shift_signed(n0, -t, "nearest")
    sigma = isqrt(n)
    es = (ev - t) // 2
    rstd = idiv_round(np.asarray(1 << RSTD_NUM_LOG2, np.int64), sigma)
    return rstd, -RSTD_NUM_LOG2 - es


def eps_rise(eps: FixedScalar, sh: np.ndarray) -> np.ndarray:
    """k = max(0, bitlen(num) + sh - EPS_BITS) (0 for eps = 0): how far var + eps is summed
    above var's exponent so that eps aligned there stays below 2^EPS_BITS."""
    if eps.num == 0:
        return np.zeros_like(i64(sh))
    return np.maximum(eps.num.bit_length() + i64(sh) - EPS_BITS, 0)


def _affine(
    xhat: MX, gamma: MX, beta: MX, ctx: RoundCtx, tid: int, j: int, shape: tuple[int, ...]
) -> MX:
    """y = gamma * xhat + beta: product at e_g + e_xhat (|.| < 2^14), aligned_sum with beta
    (sites j, j+1), compaction (site j+2)."""
    eg, eb = scalar_exp(gamma, "gamma"), scalar_exp(beta, "beta")
    xh = _as_ncs(xhat.m)
    prod = xh * i64(gamma.m)[None, :, None]
    b = i64(beta.m)[None, :, None]
    keys = [site_key(ctx, tid, j), site_key(ctx, tid, j + 1)]
    terms = [(prod, int(xhat.e) + eg, 2 * MAG), (b, eb, MAG)]
    starts = [row_offset(prod, ctx.rows), 0]
    acc, e = aligned_sum_fast(terms, ctx.rounding, keys, starts)
    return compact_mx(acc.reshape(shape), e, ctx, site_key(ctx, tid, j + 2), batch=True)


def batchnorm_affine(xhat: MX, gamma: MX, beta: MX, ctx: RoundCtx, tid: int) -> MX:
    """The output of batchnorm_forward_train computed again from its saved xhat: the affine
    sites 2, 3 and 4 of node `tid`, with the same keys, so the bits are the forward's
    (docs/layers.md, "Batch norm's output, recomputed"). The backward pass uses it in place of
    a stored output (the rematerialize pass)."""
    xh = _as_ncs(xhat.m).astype(np.int8, copy=False)
    if not debug_on() and ctx.rows is None and not channels_on(ctx):
        y = _affine_fast(xh, xhat, gamma, beta, ctx, tid, 2, xhat.shape)
        if y is not None:
            return y
    return _affine(xhat, gamma, beta, ctx, tid, 2, xhat.shape)


def _var_shift(amax: np.ndarray, m: int) -> np.ndarray:
    """Per-channel pre-shift r: smallest with m * ceil(amax / 2^r)^2 <= 2^31 - 1."""
    r = np.zeros(amax.shape, np.int64)
    while True:
        top = -((-amax) >> r)  # ceil(amax / 2^r)
        over = m * top * top > 2**31 - 1
        if not np.any(over):
            return r
        r = np.where(over, r + 1, r)


def _compact_plan(amax: np.ndarray, e_grp: np.ndarray, bits: int) -> tuple[int, np.ndarray]:
    """compact_common's target exponent and per-group shifts for exact per-group max |acc|
    (common_shifts: 0 for an all-zero group)."""
    s = compaction_shift(amax, bits)
    cand = e_grp + s
    e_out = int(cand[amax > 0].max()) if np.any(amax > 0) else int(e_grp.max())
    return e_out, common_shifts(e_out, e_grp, amax)


def _forward_train_fast(
    x: MX, gamma: MX, beta: MX, eps: float | FixedScalar, ctx: RoundCtx, tid: int
) -> tuple[MX, BatchNormSaved] | None:
    """Bit-identical blocked int32 form of batchnorm_forward_train for int8 input (None when a
    precondition of the int32 arithmetic fails: the checked reference path then runs).

    The input is int8, so |xc| <= 254 * 2^f <= 65024 and xc * rstd < 65024 * 2^15 < 2^31; the
    per-channel max |xc| follows exactly from the channel max/min of the input, and max |xc * rstd|
    = max |xc| * rstd (rstd > 0), so no scan of xc or of the product is needed. The work runs in
    blocks of batch rows that stay in cache; the random words use the same flat indices."""
    xm = np.asarray(x.m)
    if xm.dtype != np.int8 or xm.ndim not in (2, 4) or x.e.ndim != 0:
        return None
    if gamma.e.ndim != 0 or beta.e.ndim != 0:
        return None
    ex = int(x.e)
    shape = xm.shape
    n, c = shape[0], shape[1]
    x3 = xm.reshape(n, c, -1)
    sp = x3.shape[2]
    m = n * sp
    if m < 2 or n == 0:
        return None
    f = mean_frac_bits(m)
    ssum = x3.sum(axis=(0, 2), dtype=np.int64)
    xmax = x3.max(axis=(0, 2)).astype(np.int64)
    xmin = x3.min(axis=(0, 2)).astype(np.int64)
    mu = idiv_round(ssum << f, m)  # exponent ex - f
    e_c = ex - f
    amax = np.maximum((xmax << f) - mu, mu - (xmin << f))  # == max |xc| per channel
    r = _var_shift(amax, m)
    if int(r.max()) > 30 or int(amax.max()) + (1 << int(r.max())) >= 2**31:
        return None
    rows = block_rows(x3.shape)
    row = c * sp
    mu32 = mu.astype(np.int32).reshape(1, c, 1)
    r32 = r.astype(np.int32).reshape(1, c, 1)
    xc = np.empty((min(rows, n), c, sp), np.int32)
    buf = np.empty_like(xc)
    rb = RoundBlocks(r.reshape(1, c, 1), ctx.rounding, site_key(ctx, tid, 0), row)
    vsum = np.zeros(c, np.int64)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        xb = xc[: i1 - i0]
        np.left_shift(x3[i0:i1], np.int32(f), out=xb, dtype=np.int32)
        xb -= mu32
        b = rb.offsets(i0, buf[: i1 - i0])
        b += xb
        b >>= r32
        b *= b  # |tq| <= ceil(amax / 2^r): the square and the channel sums fit int32
        vsum += b.sum(axis=2, dtype=np.int64).sum(axis=0)
    sv = np.maximum(30 - bit_length(vsum), 0)
    vnum = vsum << sv
    var_m = idiv_round(vnum, m)
    var_u = idiv_round(vnum, m - 1)
    ev = 2 * (e_c + r) - sv
    rstd, rstd_e = _rstd(var_m, ev, _eps_fixed(eps))
    # xhat = compact_common(xc * rstd) with the exact per-channel max |xc * rstd|
    pmax = amax * rstd
    e_x, sh = _compact_plan(pmax, e_c + rstd_e, ctx.bits)
    if int(sh.max()) > 30 or int(pmax.max()) >= 2**31:
        return None
    split = int(pmax.max()) + (1 << int(sh.max())) - 1 >= 2**31
    sh32 = sh.astype(np.int32).reshape(1, c, 1)
    rstd32 = rstd.astype(np.int32).reshape(1, c, 1)
    low_mask = ((np.int32(1) << sh32) - np.int32(1)) if split else None
    rb = RoundBlocks(sh.reshape(1, c, 1), ctx.rounding, site_key(ctx, tid, 1), row)
    xh = np.empty(x3.shape, np.int8)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        xb = xc[: i1 - i0]
        np.left_shift(x3[i0:i1], np.int32(f), out=xb, dtype=np.int32)
        xb -= mu32
        xb *= rstd32
        b = rb.offsets(i0, buf[: i1 - i0])
        if split:  # floor((a + r) / 2^s) = (a >> s) + (((a & mask) + r) >> s), no overflow
            b += xb & low_mask
            b >>= sh32
            xb >>= sh32
            b += xb
        else:
            b += xb
            b >>= sh32
        xh[i0:i1] = b
    xhat = MX.of(xh.reshape(shape), e_x)
    y = batchnorm_affine(xhat, gamma, beta, ctx, tid)
    saved = BatchNormSaved(
        xhat=xhat,
        rstd=rstd,
        rstd_e=rstd_e,
        gamma=gamma,
        mean=Acc(mu, np.asarray(e_c, np.int64)),
        var=Acc(var_m, ev),
        var_unbiased=Acc(var_u, ev),
        count=m,
    )
    return y, saved


def _affine_fast(
    xh: np.ndarray,
    xhat: MX,
    gamma: MX,
    beta: MX,
    ctx: RoundCtx,
    tid: int,
    j: int,
    shape: tuple[int, ...],
) -> MX | None:
    """_affine when the product term needs no shift (the target exponent is its own): then
    acc = xhat * gamma + aligned(beta) per channel, whose max |.| follows from the channel
    max/min of xhat; output compaction in blocks. xh: the (N, C, S) int8 mantissas of xhat."""
    eg, eb = scalar_exp(gamma, "gamma"), scalar_exp(beta, "beta")
    n, c, sp = xh.shape
    e_p = int(xhat.e) + eg
    keys = [site_key(ctx, tid, j), site_key(ctx, tid, j + 1)]
    b = i64(beta.m)[None, :, None]
    # beta's aligned value exactly as aligned_sum_fast computes it (the product term is zero
    # here and, when its shift is 0, contributes its input unchanged)
    ab, e = aligned_sum_fast(
        [(np.zeros((1, c, 1), np.int64), e_p, 2 * MAG), (b, eb, MAG)], ctx.rounding, keys
    )
    if int(e) != e_p:
        return None
    g = i64(gamma.m)
    hi = xh.max(axis=(0, 2)).astype(np.int64) * g + ab.reshape(c)
    lo = xh.min(axis=(0, 2)).astype(np.int64) * g + ab.reshape(c)
    amax = int(max(np.abs(hi).max(), np.abs(lo).max()))
    s = int(compaction_shift(amax, ctx.bits))
    if s > 30 or amax + (1 << s) - 1 >= 2**31:
        return None
    rows = block_rows(xh.shape)
    rb = RoundBlocks(s, ctx.rounding, site_key(ctx, tid, j + 2), c * sp)
    g32 = g.astype(np.int32).reshape(1, c, 1)
    ab32 = ab.astype(np.int32).reshape(1, c, 1)
    out = np.empty(xh.shape, np.int8)
    buf = np.empty((min(rows, n), c, sp), np.int32)
    acc = np.empty_like(buf)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        a = acc[: i1 - i0]
        np.multiply(xh[i0:i1], g32, out=a)
        a += ab32
        if s == 0:
            out[i0:i1] = a
            continue
        bb = rb.offsets(i0, buf[: i1 - i0])
        bb += a
        bb >>= np.int32(s)
        out[i0:i1] = bb
    return MX.of(out.reshape(shape), int(e) + s)


def batchnorm_forward_train(
    x: MX,
    gamma: MX,
    beta: MX,
    eps: float | FixedScalar,
    ctx: RoundCtx,
    tid: int,
) -> tuple[MX, BatchNormSaved]:
    """Training-mode batch norm with batch statistics.

    Sites: 0 variance pre-shift, 1 xhat compaction, 2/3 affine alignment (gamma*xhat, beta),
    4 output compaction. With ctx.rows (data parallel) the statistics are over every worker's
    rows: the sums and maxima are agreed (docs/numerics.md §16).
    """
    rows = ctx.rows
    if not debug_on() and rows is None and not channels_on(ctx):
        fast = _forward_train_fast(x, gamma, beta, eps, ctx, tid)
        if fast is not None:
            return fast
    ex = scalar_exp(x, "batchnorm input")
    x3 = _as_ncs(x.m)
    n, c, s = x3.shape
    m = global_rows(n, rows) * s
    if m < 2:
        raise ValueError("batchnorm training needs more than one value per channel")
    f = mean_frac_bits(m)
    ssum = x3.sum(axis=(0, 2))
    check_int32(ssum, "batchnorm_sum")
    if rows is not None:
        ssum = rows.sum(ssum)
        check_int32(ssum, "batchnorm_sum")
    mu = idiv_round(shift_left(ssum, f, "batchnorm_mean"), m)  # exponent ex - f
    xc = (x3 << f) - mu[None, :, None]  # |xc| <= 254 * 2^f <= 65024
    e_c = ex - f
    # variance: per-channel pre-shift r so that the M-way sum of squares fits int32
    amax = np.abs(xc).max(axis=(0, 2)) if xc.size else np.zeros(c, np.int64)
    if rows is not None:
        amax = rows.max(amax)
    r = np.zeros(c, np.int64)
    while True:
        top = -((-amax) >> r)  # ceil(amax / 2^r)
        over = m * top * top > 2**31 - 1
        if not np.any(over):
            break
        r = np.where(over, r + 1, r)
    start = row_offset(xc, rows)
    tq = fast_shift_right(xc, r[None, :, None], ctx.rounding, site_key(ctx, tid, 0), start=start)
    vsum = (tq * tq).sum(axis=(0, 2))
    check_int32(vsum, "batchnorm_var_sum")
    if rows is not None:
        vsum = rows.sum(vsum)
        check_int32(vsum, "batchnorm_var_sum")
    sv = np.maximum(30 - bit_length(vsum), 0)
    vnum = vsum << sv
    check_int32(vnum, "batchnorm_var_sum")
    var_m = idiv_round(vnum, m)
    var_u = idiv_round(vnum, m - 1)
    ev = 2 * (e_c + r) - sv
    eps_f = _eps_fixed(eps)
    rstd, rstd_e = _rstd(var_m, ev, eps_f)
    acc = xc * rstd[None, :, None]
    check_int32(acc, "batchnorm_xhat")
    xhat = compact_common(
        acc.reshape((n, c) + x.shape[2:]), e_c + rstd_e, 1, ctx, site_key(ctx, tid, 1), batch=True
    )
    y = _affine(xhat, gamma, beta, ctx, tid, 2, x.shape)
    saved = BatchNormSaved(
        xhat=xhat,
        rstd=rstd,
        rstd_e=rstd_e,
        gamma=gamma,
        mean=Acc(mu, np.asarray(e_c, np.int64)),
        var=Acc(var_m, ev),
        var_unbiased=Acc(var_u, ev),
        count=m,
    )
    return y, saved


def batchnorm_backward(
    dy: MX, saved: BatchNormSaved, ctx: RoundCtx, tid: int
) -> tuple[MX, Acc, Acc]:
    """dx = gamma * rstd / M * (M*dy - sum(dy) - xhat * sum(dy*xhat)); dgamma, dbeta as Acc.

    Sites: 0 dgamma compaction to 16 bits, 1/2/3 aligned sum (M*dy, -dbeta, -xhat*dgamma),
    4 bracket compaction to 16 bits, 5 gamma*rstd/M per-channel shift to 16 bits,
    6 dx compaction, 7 pre-shift of dy for dgamma if product_cap(M, 8) < 0. With ctx.rows
    (data parallel) M and the sums dbeta and dgamma cover every worker's rows.
    """
    rows = ctx.rows
    if not debug_on() and rows is None and not channels_on(ctx):
        fast = _backward_fast(dy, saved, ctx, tid)
        if fast is not None:
            return fast
    ed = scalar_exp(dy, "dy")
    exh = scalar_exp(saved.xhat, "xhat")
    d3 = _as_ncs(dy.m)
    xh = _as_ncs(saved.xhat.m)
    n, c, s = d3.shape
    m = global_rows(n, rows) * s
    start = row_offset(d3, rows)
    dbeta = d3.sum(axis=(0, 2))
    check_int32(dbeta, "batchnorm_dbeta")
    dp, edp = fit_product(d3, ed, m, ctx, site_key(ctx, tid, 7), start)
    dgamma = (dp * xh).sum(axis=(0, 2))
    check_int32(dgamma, "batchnorm_dgamma")
    if rows is not None:
        dbeta, dgamma = rows.sum(dbeta), rows.sum(dgamma)
        check_int32(dbeta, "batchnorm_dbeta")
        check_int32(dgamma, "batchnorm_dgamma")
    e_dg = edp + exh
    dg16, e_dg16 = fast_compact_to_bits(dgamma, e_dg, 15, ctx.rounding, site_key(ctx, tid, 0))
    lg = ceil_log2(m)
    md = d3 * m
    check_int32(md, "batchnorm_bwd")
    keys = [site_key(ctx, tid, j) for j in (1, 2, 3)]
    t, e_t = aligned_sum_fast(
        [
            (md, ed, MAG + lg),
            (-dbeta[None, :, None], ed, MAG + lg),
            (-(xh * dg16[None, :, None]), exh + int(e_dg16), MAG + 15),
        ],
        ctx.rounding,
        keys,
        [start, 0, start],
    )
    bk16, e_bk = fast_compact_to_bits(t, e_t, 15, ctx.rounding, site_key(ctx, tid, 4), rows)
    f16, e_f = _dx_factor(saved, m, ctx, tid)
    dxa = bk16 * f16[None, :, None]
    check_int32(dxa, "batchnorm_dx")
    dx = compact_common(
        dxa.reshape(dy.shape), int(e_bk) + e_f, 1, ctx, site_key(ctx, tid, 6), batch=True
    )
    return (
        dx,
        Acc(dgamma, np.asarray(e_dg, np.int64)),
        Acc(dbeta, np.asarray(ed, np.int64)),
    )


def _dx_factor(
    saved: BatchNormSaved, m: int, ctx: RoundCtx, tid: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per channel gamma * rstd / M as (F16 with |F16| <= 2^15, exponent without e_t).

    The 1/M of the BN gradient is taken here, once per channel, and not from the bracket T: a
    per-element round(T / M) at T's exponent rounds the dense mean terms (sum dy / M and
    xhat * sum dy xhat / M, a fraction of one unit where dy = 0) to zero every time, a bias that
    ruins the weight gradient of the layer below. F = gamma_m * rstd (< 2^22) is normalized to
    2^30 by L = 30 - bitlen(F), divided by M with idiv_round and shifted to 16 bits (site 5).
    """
    eg = scalar_exp(saved.gamma, "gamma")
    fac = i64(saved.gamma.m) * saved.rstd  # |.| < 127 * 2^15
    lsh = 30 - bit_length(fac)
    q = idiv_round(fac << lsh, m)  # |.| <= 2^30 / M
    sf = np.maximum(bit_length(q) - 15, 0)
    f16 = fast_shift_right(q, sf, ctx.rounding, site_key(ctx, tid, 5))  # |.| <= 2^15
    return f16, eg + saved.rstd_e - lsh + sf


def _shift_block(
    v: np.ndarray, sh: int, rb: RoundBlocks | None, i0: int, buf: np.ndarray
) -> np.ndarray:
    """shift_signed(v, sh) of an int32 block (sh > 0 rounds with rb's offsets, no overflow)."""
    if sh == 0:
        return v
    if sh < 0:
        v <<= np.int32(-sh)
        return v
    assert rb is not None
    b = rb.offsets(i0, buf)
    b += v
    b >>= np.int32(sh)
    return b


def _backward_fast(
    dy: MX, saved: BatchNormSaved, ctx: RoundCtx, tid: int
) -> tuple[MX, Acc, Acc] | None:
    """Bit-identical blocked int32 form of batchnorm_backward for int8 dy and xhat when no dy
    pre-shift is needed (product_cap(M, 8) >= 0); None when a precondition fails."""
    dm, xm = np.asarray(dy.m), np.asarray(saved.xhat.m)
    if dm.dtype != np.int8 or xm.dtype != np.int8 or dm.shape != xm.shape or dm.ndim not in (2, 4):
        return None
    if dy.e.ndim != 0 or saved.xhat.e.ndim != 0 or saved.gamma.e.ndim != 0:
        return None
    ed, exh = int(dy.e), int(saved.xhat.e)
    n, c = dm.shape[0], dm.shape[1]
    d3 = dm.reshape(n, c, -1)
    xh = xm.reshape(n, c, -1)
    sp = d3.shape[2]
    m = n * sp
    if n == 0 or m == 0 or product_cap(m, 8) < 0:
        return None
    dbeta = d3.sum(axis=(0, 2), dtype=np.int64)
    dgamma = np.multiply(d3, xh, dtype=np.int16).sum(axis=2, dtype=np.int64).sum(axis=0)
    e_dg = ed + exh
    dg16, e_dg16 = fast_compact_to_bits(dgamma, e_dg, 15, ctx.rounding, site_key(ctx, tid, 0))
    lg = ceil_log2(m)
    keys = [site_key(ctx, tid, j) for j in (1, 2, 3)]
    e3 = exh + int(e_dg16)
    z = np.zeros((1, c, 1), np.int64)
    # the per-channel term exactly as aligned_sum_fast aligns it (zero terms stay zero)
    ab, e_t = aligned_sum_fast(
        [(z, ed, MAG + lg), (-dbeta[None, :, None], ed, MAG + lg), (z, e3, MAG + 15)],
        ctx.rounding,
        keys,
    )
    target = int(e_t)
    sh1, sh3 = target - ed, target - e3
    b1, b3 = 127 * m, 127 * int(np.abs(dg16).max())
    for sh, bound in ((sh1, b1), (sh3, b3)):
        if sh > 30 or (sh > 0 and bound + (1 << sh) - 1 >= 2**31):
            return None
    if b1 << max(-sh1, 0) >= 2**31 or b3 << max(-sh3, 0) >= 2**31:
        return None
    row = c * sp
    rows = block_rows(d3.shape)
    rb1 = RoundBlocks(sh1, ctx.rounding, keys[0], row) if sh1 > 0 else None
    rb3 = RoundBlocks(sh3, ctx.rounding, keys[2], row) if sh3 > 0 else None
    ab32 = ab.astype(np.int32)
    dg32 = (-dg16).astype(np.int32).reshape(1, c, 1)
    shp = (min(rows, n), c, sp)
    t1, t3, buf1, buf3 = (np.empty(shp, np.int32) for _ in range(4))
    bk = np.empty(d3.shape, np.int32)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        k = i1 - i0
        v1 = t1[:k]
        np.multiply(d3[i0:i1], np.int32(m), out=v1, dtype=np.int32)
        a1 = _shift_block(v1, sh1, rb1, i0, buf1[:k])
        v3 = t3[:k]
        np.multiply(xh[i0:i1], dg32, out=v3, dtype=np.int32)
        a3 = _shift_block(v3, sh3, rb3, i0, buf3[:k])
        a1 += a3
        a1 += ab32
        bk[i0:i1] = a1
    amax_bk = int(max(int(bk.max()), -int(bk.min())))
    s4 = 0
    while amax_bk > (1 << 15) << s4:
        s4 += 1
    if s4:
        bk16 = round_shift_blocked(bk, s4, amax_bk, ctx.rounding, site_key(ctx, tid, 4))
        if bk16 is None:
            return None
    else:
        bk16 = bk
    e_bk = e_t + s4
    f16, e_f = _dx_factor(saved, m, ctx, tid)
    cmax = np.maximum(
        bk16.max(axis=(0, 2)).astype(np.int64), -bk16.min(axis=(0, 2)).astype(np.int64)
    )
    amax = cmax * np.abs(f16)
    e_out, shc = _compact_plan(amax, int(e_bk) + e_f, ctx.bits)
    smax = int(shc.max())
    if smax > 30 or int(amax.max()) + (1 << smax) - 1 >= 2**31:
        return None
    rb6 = RoundBlocks(shc.reshape(1, c, 1), ctx.rounding, site_key(ctx, tid, 6), row)
    sh32 = shc.astype(np.int32).reshape(1, c, 1)
    f32 = f16.astype(np.int32).reshape(1, c, 1)
    dx = np.empty(d3.shape, np.int8)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        k = i1 - i0
        v = t1[:k]
        np.multiply(bk16[i0:i1], f32, out=v)
        b = rb6.offsets(i0, buf1[:k])
        b += v
        b >>= sh32
        dx[i0:i1] = b
    return (
        MX.of(dx.reshape(dm.shape), e_out),
        Acc(dgamma, np.asarray(e_dg, np.int64)),
        Acc(dbeta, np.asarray(ed, np.int64)),
    )


def _ema(r: MX, b: Acc, momentum: FixedScalar, ctx: RoundCtx, tid: int, j: int) -> MX:
    """r <- (1 - mom) * r + mom * b. b is first compacted to |b| <= 2^15 (site j), then
    aligned_sum((2^shift - num) * r, num * b) at exponents e - shift (sites j+1, j+2),
    then compaction (site j+3): per group if r has per-channel exponents, else one exponent."""
    b16, e_b = fast_compact_to_bits(b.a, b.e, 15, ctx.rounding, site_key(ctx, tid, j))
    one_minus = (1 << momentum.shift) - momentum.num
    keys = [site_key(ctx, tid, j + 1), site_key(ctx, tid, j + 2)]
    acc, e = aligned_sum_fast(
        [
            (i64(r.m) * one_minus, r.e - momentum.shift, MAG + one_minus.bit_length()),
            (b16 * momentum.num, e_b - momentum.shift, 15 + momentum.num.bit_length()),
        ],
        ctx.rounding,
        keys,
    )
    e = np.broadcast_to(e, acc.shape) if e.ndim else e
    if r.grouped:
        mm, ee = compact(acc, e, ctx.bits, ctx.rounding, site_key(ctx, tid, j + 3), grouped=True)
        return MX.of(mm, ee)
    if e.ndim == 0:
        return compact_mx(acc, e, ctx, site_key(ctx, tid, j + 3))
    return compact_common(acc, e, 0, ctx, site_key(ctx, tid, j + 3))


def batchnorm_update_running(
    running_mean: MX,
    running_var: MX,
    batch_mean: Acc,
    batch_var: Acc,
    momentum: FixedScalar,
    ctx: RoundCtx,
    tid: int,
) -> tuple[MX, MX]:
    """Integer EMA of the running statistics (torch convention: new = (1-mom)*old + mom*batch;
    pass saved.var_unbiased as batch_var to match torch). The result keeps the granularity of the
    inputs: per-channel exponents (e shape (C,), recommended) or one exponent.

    Sites: 0-3 mean (compaction of batch mean, two alignments, compaction), 4-7 variance.
    """
    return (
        _ema(running_mean, batch_mean, momentum, ctx, tid, 0),
        _ema(running_var, batch_var, momentum, ctx, tid, 4),
    )


def batchnorm_forward_eval(
    x: MX,
    gamma: MX,
    beta: MX,
    running_mean: MX,
    running_var: MX,
    ctx: RoundCtx,
    tid: int,
    eps: float | FixedScalar = 1e-5,
) -> MX:
    """y = gamma * (x - rm) * rstd(rv + eps) + beta with the running statistics.

    Sites: 0/1 aligned x - rm (per channel exponent if rm is grouped), 2 per-channel shift of
    it to |.| <= 2^15, 3 xhat compaction,
    4/5 affine alignment, 6 output compaction.
    """
    ex = scalar_exp(x, "batchnorm input")
    x3 = _as_ncs(x.m)
    n, c, _ = x3.shape
    e_rm = running_mean.e.reshape(1, c, 1) if running_mean.grouped else running_mean.e
    keys = [site_key(ctx, tid, 0), site_key(ctx, tid, 1)]
    xc, e_xc = aligned_sum_fast(
        [(x3, ex, MAG), (-i64(running_mean.m)[None, :, None], e_rm, MAG)], ctx.rounding, keys
    )
    e_grp = np.broadcast_to(np.reshape(e_xc, (-1,)), (c,)).astype(np.int64)
    amax = np.abs(xc).max(axis=(0, 2))
    sx = np.maximum(bit_length(amax) - 15, 0)  # per channel: |xc16| <= 2^15
    xc16 = fast_shift_right(xc, sx[None, :, None], ctx.rounding, site_key(ctx, tid, 2))
    e16 = e_grp + sx
    ev = np.broadcast_to(running_var.e, (c,))
    rstd, rstd_e = _rstd(i64(running_var.m), ev, _eps_fixed(eps))
    acc = xc16 * rstd[None, :, None]
    check_int32(acc, "batchnorm_xhat")
    xhat = compact_common(
        acc.reshape((n, c) + x.shape[2:]), e16 + rstd_e, 1, ctx, site_key(ctx, tid, 3), batch=True
    )
    return _affine(xhat, gamma, beta, ctx, tid, 4, x.shape)


__all__ = [
    "BatchNormSaved",
    "batchnorm_backward",
    "batchnorm_forward_eval",
    "batchnorm_forward_train",
    "batchnorm_update_running",
]
