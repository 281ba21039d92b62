"""Vision Transformer kernels, integer only: LayerNorm, GELU, row softmax, batched matmul,
scaling by a host constant, broadcast add (positional embedding) and mean over tokens.

Every activation is an MX with one exponent; parameter gradients are un-compacted `Acc`.
Rounding site j of a kernel called with base id `tid` uses ctx.key(tid + j); the sites of each
kernel are listed in its docstring and in docs/layers.md ("Transformer kernels").

The token-wise Linear needs no kernel: `linear_forward` flattens the leading dims of x
([B, T, D] -> [B*T, D]); `linear_backward_weight` / `linear_backward_input` do the same.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from mexc.kernels._common import (
    MAG,
    align_term,
    aligned_sum_fast,
    aligned_target,
    bit_length,
    compact_common,
    compact_mx,
    fast_compact_to_bits,
    fast_shift_right,
    fit_product,
    global_rows,
    i64,
    int_matmul,
    product_bits,
    row_offset,
    scalar_exp,
    site_key,
)
from mexc.kernels.activation import table_product
from mexc.kernels.elementwise import factor_view
from mexc.kernels.norm import _eps_fixed, _rstd, _var_shift, mean_frac_bits
from mexc.kernels.pool import DIV_BITS, _divide
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import (
    EXP_TABLE,
    GELU_GRAD_TABLE,
    GELU_PHI_TABLE,
    FixedScalar,
    Reciprocal,
    ceil_log2,
    check_int32,
    div_const,
    idiv_round,
    qmax,
    shift_left,
)

# --------------------------------------------------------------------------------- LayerNorm


@dataclass(frozen=True)
class LayerNormSaved:
    """What layernorm_backward needs (rows r = flattened leading dims, R = prod(shape[:-1])).

    xhat: normalized input, int8 mantissas [..., D], one exponent.
    rstd / rstd_e: per-row integer 1/sigma in [2^14, 2^15] and its per-row exponent, (R,).
    gamma: the scale parameter used in the forward. mean (R,) one exponent; var (R,) per-row
    exponents (biased); count: D.
    """

    xhat: MX
    rstd: np.ndarray
    rstd_e: np.ndarray
    gamma: MX
    mean: Acc
    var: Acc
    count: int
    groups: int = 1  # GroupNorm: rows are (sample, group) and the affine is per channel
    per: int = 1


def norm_rows(shape: tuple[int, ...], groups: int = 1, per: int = 1) -> tuple[int, int]:
    """(R, D): the rows a layer norm of an input of `shape` normalizes, each of D elements: the
    leading axes over the last one (LayerNorm), or (sample, group) (GroupNorm: `groups`, with
    `per` elements per channel)."""
    size = int(np.prod(shape, dtype=np.int64))
    rows = size // shape[-1] if groups == 1 and per == 1 else shape[0] * groups
    return rows, size // rows


def affine_channels(rows: int, d: int, groups: int = 1, per: int = 1) -> np.ndarray:
    """The parameter index of each element of the (R, D) rows: d for LayerNorm (groups = per =
    1); for GroupNorm (rows (n, g), D = C/G x P elements of a group, P per channel) the channel
    (r mod G) C/G + d // P."""
    cg = d // per
    r = np.arange(rows, dtype=np.int64)[:, None]
    return (r % groups) * cg + np.arange(d, dtype=np.int64)[None, :] // per


def channel_sums(a: np.ndarray, groups: int, per: int) -> np.ndarray:
    """Sum of the (R, D) rows' elements per parameter index (affine_channels): over the rows for
    LayerNorm, over the samples and the P elements of each channel for GroupNorm."""
    rows, d = a.shape
    return a.reshape(rows // groups, groups, d // per, per).sum(axis=(0, 3)).reshape(-1)


def layernorm_forward(
    x: MX,
    gamma: MX,
    beta: MX,
    eps: float | FixedScalar,
    ctx: RoundCtx,
    tid: int,
    groups: int = 1,
    per: int = 1,
) -> tuple[MX, LayerNormSaved]:
    """LayerNorm over the last axis (size D), the BatchNorm recipe with rows as the groups.

    Per row r (R rows): S_r = sum x (int32); f = min(8, sum_cap(D, 8));
    mu_r = idiv_round(S_r << f, D) at e_x - f; xc = (x << f) - mu_r (|xc| <= 65024);
    variance pre-shift r_r (smallest with D ceil(max|xc_r| / 2^r)^2 < 2^31), t = shift_right(xc,
    r_r) (**site 0**), V_r = sum t^2, sv = max(0, 30 - bitlen V), var_r = idiv_round(V << sv, D)
    at ev_r = 2(e_x - f + r_r) - sv; rstd_r = idiv_round(2^29, isqrt(n_r)) (BatchNorm step 4:
    the one int32 division per row); xhat_acc = xc rstd_r (< 2^31), compact_common over rows
    (**site 1**); affine p = xhat_m gamma_m[d] (|p| < 2^14) at e_xhat + e_g,
    aligned_sum([(p, ., 14), (beta_m as (1, D), e_b, 7)]) **sites 2, 3**, compaction **site 4**.

    groups, per (groupnorm_forward): x is seen as rows (n, g) of D = C/G x P elements, and the
    affine takes the channel's gamma and beta (affine_channels); beta is aligned once per
    channel (PRNG index c), then read by every element of the channel.
    """
    ex = scalar_exp(x, "layernorm input")
    eg, eb = scalar_exp(gamma, "gamma"), scalar_exp(beta, "beta")
    if x.m.ndim < 1:
        raise ValueError("layernorm needs at least one axis")
    x2 = i64(x.m).reshape(norm_rows(x.m.shape, groups, per))
    d = x2.shape[1]
    params = (d // per * groups,)
    if gamma.shape != params or beta.shape != params:
        raise ValueError(f"layernorm gamma/beta must have shape {params}")
    f = mean_frac_bits(d)
    ssum = x2.sum(axis=1)
    check_int32(ssum, "layernorm_sum")
    mu = idiv_round(shift_left(ssum, f, "layernorm_mean"), d)  # exponent ex - f
    xc = (x2 << f) - mu[:, None]
    e_c = ex - f
    amax = np.abs(xc).max(axis=1)
    r = _var_shift(amax, d)
    start = row_offset(xc, ctx.rows)
    tq = fast_shift_right(xc, r[:, None], ctx.rounding, site_key(ctx, tid, 0), start=start)
    vsum = (tq * tq).sum(axis=1)
    check_int32(vsum, "layernorm_var_sum")
    sv = np.maximum(30 - bit_length(vsum), 0)
    vnum = vsum << sv
    check_int32(vnum, "layernorm_var_sum")
    var_m = idiv_round(vnum, d)
    ev = 2 * (e_c + r) - sv
    rstd, rstd_e = _rstd(var_m, ev, _eps_fixed(eps))
    acc = xc * rstd[:, None]
    check_int32(acc, "layernorm_xhat")
    xh = compact_common(acc, e_c + rstd_e, 0, ctx, site_key(ctx, tid, 1), batch=True)
    xhat = MX.of(xh.m.reshape(x.shape), xh.e)
    channel = affine_channels(x2.shape[0], d, groups, per)
    prod = i64(xh.m) * i64(gamma.m)[channel]
    keys = [site_key(ctx, tid, 2), site_key(ctx, tid, 3)]
    terms = [(prod, int(xh.e) + eg, 2 * MAG), (i64(beta.m), eb, MAG)]
    target = aligned_target(terms)
    y = align_term(prod, target - terms[0][1], ctx.rounding, keys[0], start)
    y = y + align_term(i64(beta.m), target - eb, ctx.rounding, keys[1], 0)[channel]
    check_int32(y, "aligned_sum")
    out = compact_mx(y.reshape(x.shape), target, ctx, site_key(ctx, tid, 4), batch=True)
    saved = LayerNormSaved(
        xhat=xhat,
        rstd=rstd,
        rstd_e=rstd_e,
        gamma=gamma,
        mean=Acc(mu, np.asarray(e_c, np.int64)),
        var=Acc(var_m, ev),
        count=d,
        groups=groups,
        per=per,
    )
    return out, saved


def layernorm_backward(
    dy: MX, saved: LayerNormSaved, ctx: RoundCtx, tid: int
) -> tuple[MX, Acc, Acc]:
    """dx = rstd / D (D g - sum_d g - xhat sum_d(g xhat)) with g = dy gamma (per element: gamma
    runs along the reduction axis, unlike BatchNorm); dgamma = sum_rows dy xhat, dbeta =
    sum_rows dy (Acc, shape (D,)).

    1. dbeta at e_dy; dgamma at e_dy + e_xhat (dy pre-shifted, **site 7**, if
       product_cap(R, 8) < 0).
    2. g = dy_m gamma_m (|g| < 2^14, exact) at e_dy + e_g; if 21 + ceil log2 D > 31, g is
       pre-shifted by the excess (**site 5**) so the D-wide sum of g xhat fits int32.
    3. sg_r = sum_d g; sgx_r = sum_d g xhat_m at e_g + e_xhat; sgx16 = compact_to_bits(sgx, 15)
       per tensor (**site 0**).
    4. T = aligned_sum([(D g, e_g, 14 + lg), (-sg_r (R,1), e_g, 14 + lg),
       (-(xhat_m sgx16_r), e_xhat + e_sgx16, 22)]) **sites 1, 2, 3** (lg = ceil log2 D).
    5. T16 = compact_to_bits(T, 15) (**site 4**); Bk = div_const(T16, Reciprocal.of(D)).
    6. dx_acc = Bk rstd_r (<= 2^30) at e_Bk + E_r,r; dx = compact_common over rows (**site 6**).
    """
    ed = scalar_exp(dy, "dy")
    exh = scalar_exp(saved.xhat, "xhat")
    eg = scalar_exp(saved.gamma, "gamma")
    d, groups, per = saved.count, saved.groups, saved.per
    d2 = i64(dy.m).reshape(-1, d)
    xh = i64(saved.xhat.m).reshape(-1, d)
    # the terms of each parameter's sum: the rows (LayerNorm), or samples x P (GroupNorm)
    terms = global_rows(d2.shape[0], ctx.rows) // groups * per
    start = row_offset(d2, ctx.rows)
    dbeta = channel_sums(d2, groups, per)  # with ctx.rows: this worker's share (ALL_REDUCE)
    check_int32(dbeta, "layernorm_dbeta")
    dp, edp = fit_product(d2, ed, terms, ctx, site_key(ctx, tid, 7), start)
    dgamma = channel_sums(i64(dp) * xh, groups, per)
    check_int32(dgamma, "layernorm_dgamma")
    lg = ceil_log2(d)
    g = d2 * i64(saved.gamma.m)[affine_channels(d2.shape[0], d, groups, per)]
    e_g = ed + eg
    pre = 2 * MAG + MAG + lg - 31
    if pre > 0:
        g = fast_shift_right(g, pre, ctx.rounding, site_key(ctx, tid, 5), start=start)
        e_g += pre
    sg = g.sum(axis=1, keepdims=True)
    sgx = (g * xh).sum(axis=1, keepdims=True)
    check_int32(sgx, "layernorm_sgx")
    key0 = site_key(ctx, tid, 0)
    sgx16, e_sgx = fast_compact_to_bits(sgx, e_g + exh, 15, ctx.rounding, key0, ctx.rows)
    dg = g * d  # |.| < 2^(14 + lg)
    check_int32(dg, "layernorm_bwd")
    keys = [site_key(ctx, tid, j) for j in (1, 2, 3)]
    t, e_t = aligned_sum_fast(
        [
            (dg, e_g, 2 * MAG + lg),
            (-sg, e_g, 2 * MAG + lg),
            (-(xh * sgx16), exh + int(e_sgx), MAG + 15),
        ],
        ctx.rounding,
        keys,
        [start, row_offset(sg, ctx.rows), start],
    )
    t16, e_t16 = fast_compact_to_bits(t, e_t, 15, ctx.rounding, site_key(ctx, tid, 4), ctx.rows)
    bk, e_bk = div_const(t16, e_t16, Reciprocal.of(d))
    dxa = bk * saved.rstd[:, None]
    check_int32(dxa, "layernorm_dx")
    e_dx = int(e_bk) + saved.rstd_e
    dxm = compact_common(dxa, e_dx, 0, ctx, site_key(ctx, tid, 6), batch=True)
    return (
        MX.of(dxm.m.reshape(dy.shape), dxm.e),
        Acc(dgamma, np.asarray(edp + exh, np.int64)),
        Acc(dbeta, np.asarray(ed, np.int64)),
    )


# -------------------------------------------------------------------------------------- GELU


def gelu_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    """y = x Phi(x): activation.table_product(x, x, GELU_PHI_TABLE) (index rounding **site 0**,
    the product compacted at **site 1**), as SiLU is x sigmoid(x)."""
    return table_product(x, x, GELU_PHI_TABLE, ctx, tid)


def gelu_backward(dy: MX, x: MX, ctx: RoundCtx, tid: int) -> MX:
    """dx = dy GELU'(x): G = GELU_GRAD_TABLE.lookup(x) (index rounding **site 0**, clamped, so
    x >= 4 gives GELU'(3.97) = 1.0003 and x < -4 gives GELU'(-4) = -4.7e-4: the asymptotes);
    acc = dy_m G (|.| < 2^22) at e_dy - 14; compaction **site 1**: activation.table_product."""
    return table_product(dy, x, GELU_GRAD_TABLE, ctx, tid)


# ----------------------------------------------------------------------------------- softmax

SOFTMAX_RECIP_LOG2 = 30  # R = round(2^30 / S), S in [2^15, K 2^15] -> R <= 2^15


def softmax_prob_exp(bits: int) -> int:
    """Fixed exponent of the probabilities: -(B - 1) (value p 2^-(B-1), p in [0, qmax(B)])."""
    return -(bits - 1)


def causal_hidden(shape: tuple[int, ...]) -> np.ndarray:
    """The entries a causal softmax over scores of `shape` (..., Tq, Tk) hides: key j after
    query i (j > i, aligned at the top left as torch's is_causal), broadcast over the leading
    axes."""
    tq, tk = shape[-2], shape[-1]
    return np.arange(tk)[None, :] > np.arange(tq)[:, None]


# the comparisons a key mask may make of the token ids (the op's `key_cmp`; Python's operators,
# so numpy arrays and the TIR kernels' expressions take the same ones), and each one's negation
# (a mask that names the keys taking part hides the others)
KEY_CMPS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
            "gt": operator.gt, "ge": operator.ge}  # fmt: skip
KEY_CMP_NEGATED = {"eq": "ne", "ne": "eq", "lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}


def key_hidden(ids: np.ndarray, cmp: str, value: int) -> np.ndarray:
    """The keys a key mask hides: `ids cmp value` (ids [N, Tk]; bool of the same shape)."""
    return np.asarray(KEY_CMPS[cmp](np.asarray(ids, np.int64), value))


def softmax_forward(
    x: MX, ctx: RoundCtx, tid: int, causal: bool = False, hidden_keys: np.ndarray | None = None
) -> MX:
    """Row softmax along the last axis (K entries), probabilities as an MX with mantissas in
    [0, qmax(B)] (unsigned, [0, 127] for 8 bits) at the fixed exponent -(B - 1).

    d = m - rowmax(m) <= 0; E = EXP_TABLE.lookup(d, e_x) (index rounding **site 0**; values at
    2^-15, E(0) = 2^15, d below -8 clamps to exp(-8)); S = row sum (int32, K <= 2^16);
    R = idiv_round(2^30, S) (the one integer division per row, R <= 2^15);
    p = min(shift_right(E R, 30 - (B - 1)) (**site 1**), qmax(B)) (E R <= 2^30).
    `causal`: the entries causal_hidden names take no part: the row max is over the others,
    their E is 0 (so is their p), and every other step is the same (each row keeps j = 0).
    `hidden_keys` (bool [N, Tk], key_hidden's; x (N, ..., Tk)): key j of every row of sample n
    is hidden likewise where hidden_keys[n, j]; a row with every key hidden has S = 0, R = 0
    and p = 0.
    """
    e = scalar_exp(x, "softmax input")
    m = i64(x.m)
    k = m.shape[-1]
    if k > 1 << 16:
        raise ValueError("softmax rows longer than 2^16 overflow the int32 row sum")
    hidden = causal_hidden(m.shape) if causal else None
    if hidden_keys is not None:
        keys = np.asarray(hidden_keys, bool)
        if keys.shape != (m.shape[0], k):
            raise ValueError(f"a key mask {list(keys.shape)} for scores {list(m.shape)}")
        keys = keys.reshape((m.shape[0],) + (1,) * (m.ndim - 2) + (k,))
        hidden = keys if hidden is None else hidden | keys
    if hidden is not None:
        m = np.where(hidden, np.iinfo(np.int8).min, m)  # below every unhidden entry's max
    d = m - m.max(axis=-1, keepdims=True)
    start = row_offset(d, ctx.rows)
    ex = EXP_TABLE.lookup(d, e, ctx.rounding, site_key(ctx, tid, 0), start)
    if hidden is not None:
        ex = np.where(hidden, 0, ex)
    srow = ex.sum(axis=-1, keepdims=True)
    check_int32(srow, "softmax_sum")
    recip = idiv_round(np.asarray(1 << SOFTMAX_RECIP_LOG2, np.int64), np.maximum(srow, 1))
    if hidden_keys is not None:
        recip = np.where(srow == 0, 0, recip)  # every key hidden: p = 0 throughout the row
    prod = ex * recip
    check_int32(prod, "softmax_norm")
    pe = softmax_prob_exp(ctx.bits)
    sh = SOFTMAX_RECIP_LOG2 + pe
    p = fast_shift_right(prod, sh, ctx.rounding, site_key(ctx, tid, 1), start=start)
    return MX.of(np.minimum(p, qmax(ctx.bits)), pe)


def softmax_backward(dy: MX, p: MX, ctx: RoundCtx, tid: int) -> MX:
    """dx = p (dy - sum_k dy p) along the last axis.

    s_r = sum_k dy_m p_m at e_dy + e_p (dy pre-shifted, **site 5**, if product_cap(K, 8) < 0);
    t = aligned_sum([(dy_m, e_dy, 7), (-s_r (..., 1), e_dy + e_p, 14 + ceil log2 K)])
    **sites 1, 2**; t16 = compact_to_bits(t, 15) (**site 3**); acc = p_m t16 (< 2^22) at
    e_p + e_t16; compaction **site 4**.
    """
    ed, ep = scalar_exp(dy, "dy"), scalar_exp(p, "softmax probabilities")
    k = dy.shape[-1]
    start = row_offset(dy.m, ctx.rows)
    dm, eds = fit_product(i64(dy.m), ed, k, ctx, site_key(ctx, tid, 5), start)
    s = (i64(dm) * i64(p.m)).sum(axis=-1, keepdims=True)
    check_int32(s, "softmax_bwd_sum")
    keys = [site_key(ctx, tid, 1), site_key(ctx, tid, 2)]
    terms = [(i64(dy.m), ed, MAG), (-s, eds + ep, product_bits(k))]
    starts = [start, row_offset(s, ctx.rows)]
    t, e_t = aligned_sum_fast(terms, ctx.rounding, keys, starts)
    key3 = site_key(ctx, tid, 3)
    t16, e_t16 = fast_compact_to_bits(t, e_t, DIV_BITS, ctx.rounding, key3, ctx.rows)
    acc = i64(p.m) * t16
    check_int32(acc, "softmax_bwd")
    return compact_mx(acc, ep + e_t16, ctx, site_key(ctx, tid, 4), batch=True)


# ------------------------------------------------------------------------------------ matmul


def _check_batch(a: MX, b: MX, what: str) -> None:
    if a.m.ndim < 2 or b.m.ndim < 2 or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"{what}: operands need equal leading dims, got {a.shape} and {b.shape}")


def matmul_forward(a: MX, b: MX, ctx: RoundCtx, tid: int) -> MX:
    """y = a @ b, a [..., M, K], b [..., K, N] with equal leading (batch) dims.

    a pre-shifted (**site 3**) if product_cap(K, 8) < 0; exact int32 accumulation (int_matmul)
    at e_a + e_b; compaction over the whole tensor (**site 0**).
    """
    _check_batch(a, b, "matmul")
    ea, eb = scalar_exp(a, "matmul a"), scalar_exp(b, "matmul b")
    k = a.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"matmul: inner dims differ, {a.shape} @ {b.shape}")
    am, ea = fit_product(a.m, ea, k, ctx, site_key(ctx, tid, 3), row_offset(a.m, ctx.rows))
    acc = int_matmul(am, b.m)
    return compact_mx(acc, ea + eb, ctx, site_key(ctx, tid, 0), batch=True)


def matmul_backward(dy: MX, a: MX, b: MX, ctx: RoundCtx, tid: int) -> tuple[MX, MX]:
    """da = dy @ b^T (K-wide = N; dy pre-shifted **site 2** if product_cap(N, 8) < 0,
    compaction **site 0**); db = a^T @ dy (reduction over M; a^T pre-shifted **site 3** if
    product_cap(M, 8) < 0, compaction **site 1**)."""
    _check_batch(a, b, "matmul")
    ed = scalar_exp(dy, "dy")
    ea, eb = scalar_exp(a, "matmul a"), scalar_exp(b, "matmul b")
    n, m = b.shape[-1], a.shape[-2]
    rows = ctx.rows
    dm, ed1 = fit_product(dy.m, ed, n, ctx, site_key(ctx, tid, 2), row_offset(dy.m, rows))
    da_acc = int_matmul(dm, np.swapaxes(b.m, -1, -2))
    da = compact_mx(da_acc, ed1 + eb, ctx, site_key(ctx, tid, 0), batch=True)
    a_t = np.swapaxes(a.m, -1, -2)
    at, ea2 = fit_product(a_t, ea, m, ctx, site_key(ctx, tid, 3), row_offset(a_t, rows))
    db = compact_mx(int_matmul(at, dy.m), ea2 + ed, ctx, site_key(ctx, tid, 1), batch=True)
    return da, db


# ----------------------------------------------------------------------------- scale by const


def scale_forward(x: MX, s: FixedScalar, ctx: RoundCtx, tid: int) -> MX:
    """y = x s, s = num 2^-shift a host constant (e.g. FixedScalar.of(1 / sqrt(d_head))):
    acc = m num (< 2^22) at e_x - shift; compaction (**site 0**). A power of two is exact."""
    e = scalar_exp(x, "scale input")
    acc = i64(x.m) * int(s.num)
    return compact_mx(acc, e - s.shift, ctx, site_key(ctx, tid, 0), batch=True)


def scale_backward(dy: MX, s: FixedScalar, ctx: RoundCtx, tid: int) -> MX:
    """dx = dy s: the same operation on dy (**site 0** of the backward's tid)."""
    return scale_forward(dy, s, ctx, tid)


# ------------------------------------------------------------------- broadcast add (pos. emb.)


def add_broadcast_forward(x: MX, p: MX, ctx: RoundCtx, tid: int, view: tuple[int, ...] = ()) -> MX:
    """y = x + p, p broadcast over x: seen as `view` (p's own shape when empty), [1, ...] over
    the batch axis (a positional embedding), [1, C, 1, 1] per channel, [1] for all; x seen as
    (O, M, I) by factor_view, p as (M,).

    aligned_sum([(x_m, e_x, 7), (p_m, e_p, 7)]) **sites 0 (x), 1 (p)** (p is aligned once, PRNG
    index = its own flat index, then broadcast); compaction **site 2**.
    The backward of x is dy itself; of p, add_broadcast_param_grad.
    """
    shape = tuple(view) or tuple(p.shape)
    if (
        len(shape) != x.m.ndim
        or shape[0] != 1
        or int(np.prod(shape)) != p.m.size
        or factor_view(tuple(x.shape), shape) is None
    ):
        raise ValueError(f"add_broadcast: p seen as {shape} does not broadcast to {x.shape}")
    ex, ep = scalar_exp(x, "x"), scalar_exp(p, "p")
    keys = [site_key(ctx, tid, 0), site_key(ctx, tid, 1)]
    terms = [(i64(x.m), ex, MAG), (i64(p.m.reshape(shape)), ep, MAG)]
    acc, e = aligned_sum_fast(terms, ctx.rounding, keys, [row_offset(x.m, ctx.rows), 0])
    full = np.broadcast_to(acc, x.shape)
    return compact_mx(full, e, ctx, site_key(ctx, tid, 2), batch=True)


def param_view(
    view: tuple[int, ...], x_shape: tuple[int, ...], p_shape: tuple[int, ...]
) -> tuple[int, int, int]:
    """x of an add_param (or its dy) seen as (O, M, I) with the parameter along M: from the
    node's `view` attribute, or the parameter's own [1, ...] shape when that is empty."""
    view = tuple(view) or tuple(p_shape)
    ovm = factor_view(tuple(x_shape), view)
    if ovm is None:
        raise ValueError(f"add_param: {view} does not broadcast to {x_shape}")
    return ovm


def add_broadcast_param_grad(dy: MX, view: tuple[int, ...] = ()) -> Acc:
    """dp = sum of dy over the axes p is broadcast along (the batch axis, and those where
    `view` is 1), keepdims (shape `view`, or (1, ...)), int32, exponent e_dy."""
    ed = scalar_exp(dy, "dy")
    axes = tuple(i for i, d in enumerate(view) if d == 1 and dy.shape[i] != 1) or (0,)
    acc = i64(dy.m).sum(axis=axes, keepdims=True)
    check_int32(acc, "add_broadcast_param_grad")
    return Acc(acc, np.asarray(ed, np.int64))


def gather_param_forward(p: MX, index: np.ndarray, batch: int) -> MX:
    """y[b, j] = p.flat[index[j]] for every b < batch (a parameter read through an index map:
    a relative-position bias table, a sliced or permuted embedding): mantissas copied,
    exponent e_p kept. Result [batch, len(index)]."""
    ep = scalar_exp(p, "p")
    rows = np.asarray(p.m).reshape(-1)[np.asarray(index, np.int64)]
    return MX(np.ascontiguousarray(np.broadcast_to(rows, (batch, rows.size))), np.asarray(ep))


def gather_param_grad(dy: MX, index: np.ndarray, size: int) -> Acc:
    """dp.flat[k] = the int32 sum of dy[b, j] over the batch and every j with index[j] = k
    (dy [batch, len(index)]), exponent e_dy: the gathered copies' gradients summed, as
    add_broadcast_param_grad sums a broadcast parameter's."""
    ed = scalar_exp(dy, "dy")
    per = i64(dy.m).reshape(dy.shape[0], -1).sum(axis=0)
    acc = np.zeros(size, np.int64)
    np.add.at(acc, np.asarray(index, np.int64), per)
    check_int32(acc, "gather_param_grad")
    return Acc(acc, np.asarray(ed, np.int64))


def embedding_forward(w: MX, ids: np.ndarray) -> MX:
    """y[..., :] = w[ids[...], :] (w [V, D], ids any shape of integers in [0, V)): the table's
    rows copied, exponent e_w kept (docs/numerics.md §7b, "Embedding lookup"). Result
    ids.shape + (D,)."""
    ew = scalar_exp(w, "embedding table")
    idx = np.asarray(ids, np.int64)
    return MX(np.ascontiguousarray(np.asarray(w.m)[idx]), np.asarray(ew))


def embedding_grad(dy: MX, ids: np.ndarray, vocab: int, padding_idx: int = -1) -> Acc:
    """dw[k, :] = the int32 sum of dy[i, :] over the positions i with ids[i] = k, those of
    `padding_idx` (when >= 0) left out (dy ids.shape + (D,)), exponent e_dy."""
    ed = scalar_exp(dy, "dy")
    idx = np.asarray(ids, np.int64).reshape(-1)
    rows = i64(dy.m).reshape(idx.size, -1)
    keep = idx != padding_idx
    acc = np.zeros((vocab, rows.shape[1]), np.int64)
    np.add.at(acc, idx[keep], rows[keep])
    check_int32(acc, "embedding_grad")
    return Acc(acc, np.asarray(ed, np.int64))


# ------------------------------------------------------------------------------ token mean


def mean_tokens_forward(x: MX, ctx: RoundCtx, tid: int) -> MX:
    """y[b, d] = mean_t x[b, t, d] (x [B, T, D]): sum over T (|.| < 2^(7 + ceil log2 T)), then
    pool._divide: exact left shift to 15 bits (or compact_to_bits(., 15), **site 0**),
    div_const by T (Reciprocal.of(T); the power of two goes to the exponent), compaction
    (**site 1**)."""
    e = scalar_exp(x, "mean_tokens input")
    if x.m.ndim != 3:
        raise ValueError(f"mean_tokens needs [B, T, D], got {x.shape}")
    t = x.shape[1]
    acc = i64(x.m).sum(axis=1)
    check_int32(acc, "mean_tokens_forward")
    return _divide(acc, e, MAG + ceil_log2(t), t, ctx, tid)


def mean_tokens_backward(dy: MX, t: int, ctx: RoundCtx, tid: int) -> MX:
    """dx[b, t, d] = dy[b, d] / T: g = div_const(dy << 8, Reciprocal.of(T)) at
    e_dy - 8 - pow2 (exact, no site), broadcast to [B, T, D], compaction (**site 0**, PRNG index
    over [B, T, D])."""
    e = scalar_exp(dy, "dy")
    if dy.m.ndim != 2:
        raise ValueError(f"mean_tokens backward needs dy [B, D], got {dy.shape}")
    g, eg = div_const(i64(dy.m) << (DIV_BITS - MAG), e - (DIV_BITS - MAG), Reciprocal.of(t))
    b, d = dy.shape
    full = np.broadcast_to(g[:, None, :], (b, t, d))
    return compact_mx(full, eg, ctx, site_key(ctx, tid, 0), batch=True)


__all__ = [
    "LayerNormSaved",
    "add_broadcast_forward",
    "add_broadcast_param_grad",
    "embedding_forward",
    "embedding_grad",
    "gather_param_forward",
    "gather_param_grad",
    "gelu_backward",
    "gelu_forward",
    "layernorm_backward",
    "layernorm_forward",
    "matmul_backward",
    "matmul_forward",
    "mean_tokens_backward",
    "mean_tokens_forward",
    "scale_backward",
    "scale_forward",
    "softmax_backward",
    "softmax_forward",
    "softmax_prob_exp",
]
