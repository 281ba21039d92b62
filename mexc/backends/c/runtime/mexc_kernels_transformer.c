/* Vision Transformer kernels: the C form of mexc/kernels/transformer.py (docs/layers.md,
 * "Transformer kernels"): LayerNorm, row softmax, batched matmul, scaling by a host
 * constant, broadcast add (positional embedding), plus the data movement ops (transpose, slice).
 * Flat element indices, rounding sites and operation order as the numpy kernels. */
#include "mexc_kernels.h"

#define SOFTMAX_RECIP_LOG2 30

/* ------------------------------------------------------------------ LayerNorm */

/* The parameter index of element i of row rr (transformer.affine_channels): i for LayerNorm
 * (groups = per = 1), the channel (rr mod G) C/G + i / P for GroupNorm. Walked without a
 * division per element: `ln_channel_start` at each row, `ln_channel_next` after each element. */
typedef struct {
    uint32_t c, q, per;
} ln_channel_t;

static void ln_channel_start(ln_channel_t *w, uint32_t rr, uint32_t d, uint32_t groups,
                             uint32_t per)
{
    w->c = (rr % groups) * (d / per);
    w->q = 0;
    w->per = per;
}

static void ln_channel_next(ln_channel_t *w)
{
    if (++w->q == w->per) {
        w->q = 0;
        w->c++;
    }
}

int32_t mexc_layernorm_forward(uint32_t rows, uint32_t d, const int8_t *x, int32_t ex,
                               const int8_t *gamma, int32_t eg, const int8_t *beta, int32_t eb,
                               mexc_fixed_t eps, int8_t *y, mexc_ln_saved_t *sv,
                               const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch,
                               uint32_t groups, uint32_t per)
{
    ln_channel_t ch;
    int32_t *mu = scratch, *e_grp = scratch + rows, *cshift = scratch + 2u * rows;
    uint32_t *camax = (uint32_t *)(scratch + 3u * rows);
    const uint32_t lim = 0x7FFFFFFFu / d, key0 = mexc_site_key(ctx, tid, 0);
    const int32_t st = ctx->stochastic;
    int32_t f = 31 - (7 + mexc_ceil_log2(d)), e_c, ssum, xc, tq, shv, var, ev, r, tgt, v;
    int32_t e[2], b[2], e_out = 0;
    uint32_t rr, i, idx, amax, a, top, vsum, k2, k3;
    mexc_sink_t sink;
    f = f < 8 ? f : 8; /* norm.mean_frac_bits */
    e_c = ex - f;
    sv->rows = rows;
    sv->d = d;
    for (rr = 0; rr < rows; rr++) {
        const int8_t *xr = x + rr * d;
        ssum = 0;
        for (i = 0; i < d; i++) ssum += xr[i];
        mu[rr] = mexc_idiv_round(mexc_shift_left(ssum, f), d);
        amax = 0;
        for (i = 0; i < d; i++) {
            a = mexc_uabs(mexc_shift_left(xr[i], f) - mu[rr]);
            amax = a > amax ? a : amax;
        }
        r = 0; /* norm._var_shift: smallest r with D ceil(amax / 2^r)^2 <= 2^31 - 1 */
        for (;;) {
            top = (amax + ((1u << r) - 1u)) >> r;
            if (top * top <= lim) break;
            r++;
        }
        vsum = 0;
        for (i = 0; i < d; i++) {
            idx = rr * d + i;
            xc = mexc_shift_left(xr[i], f) - mu[rr];
            tq = mexc_shift_right(xc, r, st, key0, idx); /* [0] */
            vsum += (uint32_t)(tq * tq);
        }
        shv = 30 - mexc_bit_length(vsum);
        shv = shv > 0 ? shv : 0;
        var = mexc_idiv_round((int32_t)(vsum << shv), d);
        ev = 2 * (e_c + r) - shv;
        sv->rstd[rr] = mexc_rstd(var, ev, eps, &sv->rstd_e[rr]);
        e_grp[rr] = e_c + sv->rstd_e[rr];
    }
    /* xhat = compact_common(xc * rstd, e_c + rstd_e, axis 0 = rows) [1] */
    mexc_sink_init(&sink, sv->xhat, ctx, mexc_site_key(ctx, tid, 1), camax, cshift, rows, -1);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) sv->xhat_e = mexc_sink_finish_common(&sink, e_grp, rows);
        for (idx = 0, rr = 0; rr < rows; rr++)
            for (i = 0; i < d; i++, idx++)
                mexc_sink_put(&sink, idx, rr,
                              (mexc_shift_left(x[idx], f) - mu[rr]) * sv->rstd[rr]);
    }
    /* y = compact(aligned_sum([(xhat gamma, e_xhat + e_g, 14), (beta, e_b, 7)])) [2, 3], [4] */
    e[0] = sv->xhat_e + eg;
    e[1] = eb;
    b[0] = 14;
    b[1] = 7;
    tgt = mexc_aligned_target(2u, e, b);
    k2 = mexc_site_key(ctx, tid, 2);
    k3 = mexc_site_key(ctx, tid, 3);
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 4), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, tgt);
        for (idx = 0, rr = 0; rr < rows; rr++)
            for (ln_channel_start(&ch, rr, d, groups, per), i = 0; i < d;
                 i++, idx++, ln_channel_next(&ch)) {
                v = mexc_shift_signed((int32_t)sv->xhat[idx] * gamma[ch.c], tgt - e[0], st, k2,
                                      idx) +
                    mexc_shift_signed(beta[ch.c], tgt - eb, st, k3, ch.c);
                mexc_sink_put(&sink, idx, 0u, v);
            }
    }
    return e_out;
}

/* g = dy gamma, pre-shifted [5] when the D-wide sum of g xhat could overflow */
static int32_t ln_g(int32_t dy, int32_t gm, int32_t pre, int32_t st, uint32_t key, uint32_t idx)
{
    return pre > 0 ? mexc_shift_right(dy * gm, pre, st, key, idx) : dy * gm;
}

/* T = aligned_sum([(D g, .), (-sg_r, .), (-(xhat sgx16_r), .)]) [1, 2, 3] for one element */
static int32_t ln_t(int32_t g, uint32_t d, int32_t sg, int32_t xh, int32_t sgx16,
                    const int32_t *sh, const uint32_t *keys, int32_t st, uint32_t idx,
                    uint32_t rr)
{
    return mexc_shift_signed(g * (int32_t)d, sh[0], st, keys[0], idx) +
           mexc_shift_signed(-sg, sh[1], st, keys[1], rr) +
           mexc_shift_signed(-(xh * sgx16), sh[2], st, keys[2], idx);
}

void mexc_layernorm_backward(uint32_t rows, uint32_t d, const int8_t *dy, int32_t ed,
                             const mexc_ln_saved_t *sv, const int8_t *gamma, int32_t eg,
                             int8_t *dx, int32_t *e_dx, int32_t *dgamma, int32_t *e_dgamma,
                             int32_t *dbeta, const mexc_ctx_t *ctx, uint32_t tid,
                             int32_t *scratch, uint32_t groups, uint32_t per)
{
    ln_channel_t ch;
    const uint32_t params = groups * (d / per);
    int32_t *sg = scratch, *sgx = scratch + rows, *e_grp = scratch + 2u * rows;
    int32_t *cshift = scratch + 3u * rows;
    uint32_t *camax = (uint32_t *)(scratch + 4u * rows);
    const int32_t st = ctx->stochastic, lg = mexc_ceil_log2(d), pre = 14 + 7 + lg - 31;
    const uint32_t key5 = mexc_site_key(ctx, tid, 5), key4 = mexc_site_key(ctx, tid, 4);
    const int8_t *dp;
    int32_t edp = ed, e_g = ed + eg, g, s0, e[3], b[3], sh[3], target, t, st16 = 0, e_bk;
    uint32_t keys[3], rr, i, idx, tmax = 0;
    mexc_recip_t rc;
    mexc_sink_t sink;
    /* each parameter's sum has rows / G x P terms (the rows, or GroupNorm's samples x P) */
    dp = mexc_fit_product(dy, rows * d, &edp, rows / groups * per, ctx,
                          mexc_site_key(ctx, tid, 7), scratch + 5u * rows);
    for (i = 0; i < params; i++) {
        dgamma[i] = 0;
        dbeta[i] = 0;
    }
    for (idx = 0, rr = 0; rr < rows; rr++)
        for (ln_channel_start(&ch, rr, d, groups, per), i = 0; i < d;
             i++, idx++, ln_channel_next(&ch)) {
            dbeta[ch.c] += dy[idx];
            dgamma[ch.c] += (int32_t)dp[idx] * sv->xhat[idx];
        }
    *e_dgamma = edp + sv->xhat_e;
    if (dx == NULL) return; /* input gradient not needed */
    if (pre > 0) e_g += pre;
    for (idx = 0, rr = 0; rr < rows; rr++) {
        sg[rr] = 0;
        sgx[rr] = 0;
        for (ln_channel_start(&ch, rr, d, groups, per), i = 0; i < d;
             i++, idx++, ln_channel_next(&ch)) {
            g = ln_g(dy[idx], gamma[ch.c], pre, st, key5, idx);
            sg[rr] += g;
            sgx[rr] += g * sv->xhat[idx];
        }
    }
    s0 = mexc_compact_to_bits(sgx, sgx, rows, 15, st, mexc_site_key(ctx, tid, 0));
    e[0] = e_g;
    e[1] = e_g;
    e[2] = sv->xhat_e + (e_g + sv->xhat_e + s0); /* e_xhat + e_sgx16 */
    b[0] = 14 + lg;
    b[1] = 14 + lg;
    b[2] = 7 + 15;
    target = mexc_aligned_target(3u, e, b);
    for (i = 0; i < 3u; i++) {
        sh[i] = target - e[i];
        keys[i] = mexc_site_key(ctx, tid, 1u + i);
    }
    /* T16 = compact_to_bits(T, 15) [4]: scan max|T| */
    for (idx = 0, rr = 0; rr < rows; rr++)
        for (ln_channel_start(&ch, rr, d, groups, per), i = 0; i < d;
             i++, idx++, ln_channel_next(&ch)) {
            g = ln_g(dy[idx], gamma[ch.c], pre, st, key5, idx);
            t = ln_t(g, d, sg[rr], sv->xhat[idx], sgx[rr], sh, keys, st, idx, rr);
            tmax = mexc_uabs(t) > tmax ? mexc_uabs(t) : tmax;
        }
    while ((uint64_t)tmax > ((uint64_t)1 << 15) << st16) st16++;
    rc = mexc_recip_of(d);
    e_bk = target + st16 - (int32_t)rc.pow2;
    for (rr = 0; rr < rows; rr++) e_grp[rr] = e_bk + sv->rstd_e[rr];
    /* dx = compact_common(div_const(T16, D) rstd_r, e_bk + rstd_e, rows) [6] */
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 6), camax, cshift, rows, -1);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) *e_dx = mexc_sink_finish_common(&sink, e_grp, rows);
        for (idx = 0, rr = 0; rr < rows; rr++)
            for (ln_channel_start(&ch, rr, d, groups, per), i = 0; i < d;
                 i++, idx++, ln_channel_next(&ch)) {
                g = ln_g(dy[idx], gamma[ch.c], pre, st, key5, idx);
                t = ln_t(g, d, sg[rr], sv->xhat[idx], sgx[rr], sh, keys, st, idx, rr);
                t = mexc_shift_right(t, st16, st, key4, idx);
                mexc_sink_put(&sink, idx, rr, mexc_div_const(t, &rc) * sv->rstd[rr]);
            }
    }
}

/* ------------------------------------------------------------------ table products */

static int32_t table_lookup(const int32_t *tab, int32_t in_exp, int32_t x, int32_t e,
                            const mexc_ctx_t *ctx, uint32_t key, uint32_t idx,
                            int32_t sign_exact)
{
    int32_t t = mexc_shift_signed_sat(x, in_exp - e, ctx->stochastic, key, idx);
    t = t < -128 ? -128 : (t > 127 ? 127 : t);
    if (sign_exact && x > 0 && t < 1) t = 1;
    return tab[t + 128];
}

/* activation.table_product: a[i] (a NULL: 1) times tab[x[i] shifted to in_exp] (site 0), at
   e_a + out_exp (e_a = 0 without a factor); compaction site 1. sign_exact: a positive x reads
   an index of at least 1 (LookupTable.sign_exact). */
int32_t mexc_table_product(const int8_t *a, int32_t ea, const int8_t *x, int32_t ex,
                           const int32_t *tab, int32_t in_exp, int32_t out_exp,
                           int32_t sign_exact, uint32_t n, int8_t *out, const mexc_ctx_t *ctx,
                           uint32_t tid)
{
    const uint32_t key0 = mexc_site_key(ctx, tid, 0);
    int32_t v, e_out = 0;
    uint32_t i;
    mexc_sink_t sink;
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, 1), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, (a ? ea : 0) + out_exp);
        for (i = 0; i < n; i++) {
            v = table_lookup(tab, in_exp, x[i], ex, ctx, key0, i, sign_exact);
            mexc_sink_put(&sink, i, 0u, a ? (int32_t)a[i] * v : v);
        }
    }
    return e_out;
}

/* ------------------------------------------------------------------ softmax */

/* whether token id `id` hides its key under a key mask (kernels.transformer.key_hidden) */
static int key_hides(int32_t id, int32_t cmp, int32_t value)
{
    switch (cmp) {
    case MEXC_KEY_EQ: return id == value;
    case MEXC_KEY_NE: return id != value;
    case MEXC_KEY_LT: return id < value;
    case MEXC_KEY_LE: return id <= value;
    case MEXC_KEY_GT: return id > value;
    default: return id >= value; /* MEXC_KEY_GE */
    }
}

/* tq > 0: causal over rows of tq queries: row r is query r % tq, and its keys j > r % tq take no
 * part (their p is 0, the row max is over the others). ids != NULL: key j of row r also takes no
 * part where key_hides(ids[(r / per) k + j]); a row whose every key is hidden has p = 0 */
static int32_t softmax_rows(uint32_t rows, uint32_t k, uint32_t tq, const int32_t *ids,
                            uint32_t per, int32_t cmp, int32_t value, const int8_t *x, int32_t e,
                            int8_t *p, const mexc_ctx_t *ctx, uint32_t tid)
{
    const uint32_t key0 = mexc_site_key(ctx, tid, 0), key1 = mexc_site_key(ctx, tid, 1);
    const int32_t pe = -(ctx->bits - 1), q = mexc_qmax(ctx->bits);
    uint32_t r, j, idx, seen;
    int32_t mx, srow, recip, v, any;
    for (r = 0; r < rows; r++) {
        const int8_t *m = x + r * k;
        const int32_t *row_ids = ids ? ids + (r / per) * k : 0;
        seen = tq ? r % tq + 1 : k; /* the keys the row reads: 0 .. seen - 1 */
        if (seen > k) seen = k;
        mx = 0;
        any = 0;
        for (j = 0; j < seen; j++) {
            if (row_ids && key_hides(row_ids[j], cmp, value)) continue;
            mx = (!any || m[j] > mx) ? m[j] : mx;
            any = 1;
        }
        srow = 0;
        for (j = 0; j < seen; j++) {
            if (row_ids && key_hides(row_ids[j], cmp, value)) continue;
            srow += table_lookup(mexc_exp_table, MEXC_EXP_IN_EXP, m[j] - mx, e, ctx, key0,
                                 r * k + j, 0);
        }
        recip = srow ? mexc_idiv_round((int32_t)1 << SOFTMAX_RECIP_LOG2, (uint32_t)srow) : 0;
        for (j = 0; j < k; j++) {
            idx = r * k + j;
            if (j >= seen || (row_ids && key_hides(row_ids[j], cmp, value))) {
                p[idx] = 0;
                continue;
            }
            v = table_lookup(mexc_exp_table, MEXC_EXP_IN_EXP, m[j] - mx, e, ctx, key0, idx, 0);
            v = mexc_shift_right(v * recip, SOFTMAX_RECIP_LOG2 + pe, ctx->stochastic, key1, idx);
            p[idx] = (int8_t)(v < q ? v : q);
        }
    }
    return pe;
}

int32_t mexc_softmax_forward(uint32_t rows, uint32_t k, const int8_t *x, int32_t e, int8_t *p,
                             const mexc_ctx_t *ctx, uint32_t tid)
{
    return softmax_rows(rows, k, 0u, 0, 1u, 0, 0, x, e, p, ctx, tid);
}

int32_t mexc_softmax_causal_forward(uint32_t rows, uint32_t k, uint32_t tq, const int8_t *x,
                                    int32_t e, int8_t *p, const mexc_ctx_t *ctx, uint32_t tid)
{
    return softmax_rows(rows, k, tq, 0, 1u, 0, 0, x, e, p, ctx, tid);
}

int32_t mexc_softmax_masked_forward(uint32_t rows, uint32_t k, uint32_t tq, const int32_t *ids,
                                    uint32_t samples, int32_t cmp, int32_t value, const int8_t *x,
                                    int32_t e, int8_t *p, const mexc_ctx_t *ctx, uint32_t tid)
{
    return softmax_rows(rows, k, tq, ids, rows / samples, cmp, value, x, e, p, ctx, tid);
}

uint32_t mexc_softmax_backward_scratch(uint32_t rows, uint32_t k)
{
    return mexc_fit_scratch(rows * k, k);
}

int32_t mexc_softmax_backward(uint32_t rows, uint32_t k, const int8_t *dy, int32_t ed,
                              const int8_t *p, int32_t ep, int8_t *dx, const mexc_ctx_t *ctx,
                              uint32_t tid, int32_t *scratch)
{
    const int32_t st = ctx->stochastic;
    const uint32_t k1 = mexc_site_key(ctx, tid, 1), k2 = mexc_site_key(ctx, tid, 2);
    const uint32_t k3 = mexc_site_key(ctx, tid, 3);
    const int8_t *dm;
    int32_t eds = ed, e[2], b[2], target, s, t, s3 = 0, e_out = 0, pass;
    uint32_t r, j, idx, tmax = 0, a;
    mexc_sink_t sink;
    dm = mexc_fit_product(dy, rows * k, &eds, k, ctx, mexc_site_key(ctx, tid, 5), scratch);
    e[0] = ed;
    e[1] = eds + ep;
    b[0] = 7;
    b[1] = mexc_product_bits(k);
    target = mexc_aligned_target(2u, e, b);
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 4), NULL, NULL, 0u, 0);
    for (pass = 0; pass < 3; pass++) { /* 0: max|t| for compact_to_bits [3]; 1, 2: the sink */
        if (pass == 1)
            while ((uint64_t)tmax > ((uint64_t)1 << 15) << s3) s3++;
        if (pass == 2) e_out = mexc_sink_finish(&sink, ep + target + s3);
        for (r = 0; r < rows; r++) {
            s = 0;
            for (j = 0; j < k; j++) s += (int32_t)dm[r * k + j] * p[r * k + j];
            for (j = 0; j < k; j++) {
                idx = r * k + j;
                t = mexc_shift_signed(dy[idx], target - e[0], st, k1, idx) +
                    mexc_shift_signed(-s, target - e[1], st, k2, r);
                if (pass == 0) {
                    a = mexc_uabs(t);
                    tmax = a > tmax ? a : tmax;
                } else {
                    t = mexc_shift_right(t, s3, st, k3, idx);
                    mexc_sink_put(&sink, idx, 0u, (int32_t)p[idx] * t);
                }
            }
        }
    }
    return e_out;
}

/* ------------------------------------------------------------------ batched matmul */

uint32_t mexc_matmul_forward_scratch(uint32_t batch, uint32_t m, uint32_t k)
{
    return mexc_fit_scratch(batch * m * k, k);
}

int32_t mexc_matmul_forward(uint32_t batch, uint32_t m, uint32_t k, uint32_t n, const int8_t *a,
                            int32_t ea, const int8_t *b, int32_t eb, int8_t *y,
                            const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    const int8_t *am;
    uint32_t bb, i, j, l, idx;
    int32_t acc, e_out = 0;
    mexc_sink_t sink;
    am = mexc_fit_product(a, batch * m * k, &ea, k, ctx, mexc_site_key(ctx, tid, 3), scratch);
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, ea + eb);
        for (idx = 0, bb = 0; bb < batch; bb++) {
            const int8_t *ap = am + bb * m * k, *bp = b + bb * k * n;
            for (i = 0; i < m; i++)
                for (j = 0; j < n; j++, idx++) {
                    acc = 0;
                    for (l = 0; l < k; l++) acc += (int32_t)ap[i * k + l] * bp[l * n + j];
                    mexc_sink_put(&sink, idx, 0u, acc);
                }
        }
    }
    return e_out;
}

uint32_t mexc_matmul_backward_scratch(uint32_t batch, uint32_t m, uint32_t k, uint32_t n)
{
    uint32_t s1 = mexc_fit_scratch(batch * m * n, n), s2 = mexc_fit_scratch(batch * k * m, m);
    return s1 > s2 ? s1 : s2;
}

void mexc_matmul_backward(uint32_t batch, uint32_t m, uint32_t k, uint32_t n, const int8_t *dy,
                          int32_t ed, const int8_t *a, int32_t ea, const int8_t *b, int32_t eb,
                          int8_t *da, int32_t *e_da, int8_t *db, int32_t *e_db,
                          const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    const int32_t cap = mexc_product_cap(m);
    const uint32_t key3 = mexc_site_key(ctx, tid, 3);
    const int8_t *dm;
    int8_t *at = (int8_t *)scratch;
    uint32_t bb, i, j, l, idx;
    int32_t acc, ed1 = ed, ea2 = ea;
    mexc_sink_t sink;
    if (da != NULL) { /* da = dy @ b^T, dy pre-shifted [2], compaction [0] */
        dm = mexc_fit_product(dy, batch * m * n, &ed1, n, ctx, mexc_site_key(ctx, tid, 2),
                              scratch);
        mexc_sink_init(&sink, da, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
        for (sink.pass = 0; sink.pass < 2; sink.pass++) {
            if (sink.pass == 1) *e_da = mexc_sink_finish(&sink, ed1 + eb);
            for (idx = 0, bb = 0; bb < batch; bb++) {
                const int8_t *dp = dm + bb * m * n, *bp = b + bb * k * n;
                for (i = 0; i < m; i++)
                    for (j = 0; j < k; j++, idx++) {
                        acc = 0;
                        for (l = 0; l < n; l++) acc += (int32_t)dp[i * n + l] * bp[j * n + l];
                        mexc_sink_put(&sink, idx, 0u, acc);
                    }
            }
        }
    }
    if (db == NULL) return;
    /* db = a^T @ dy; a^T (flat index over [batch, K, M]) pre-shifted [3], compaction [1] */
    if (cap < 0) {
        for (idx = 0, bb = 0; bb < batch; bb++)
            for (j = 0; j < k; j++)
                for (i = 0; i < m; i++, idx++)
                    at[idx] = (int8_t)mexc_shift_right(a[(bb * m + i) * k + j], -cap,
                                                       ctx->stochastic, key3, idx);
        ea2 += -cap;
    }
    mexc_sink_init(&sink, db, ctx, mexc_site_key(ctx, tid, 1), NULL, NULL, 0u, 1);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) *e_db = mexc_sink_finish(&sink, ea2 + ed);
        for (idx = 0, bb = 0; bb < batch; bb++)
            for (j = 0; j < k; j++)
                for (l = 0; l < n; l++, idx++) {
                    acc = 0;
                    for (i = 0; i < m; i++) {
                        int32_t av = cap < 0 ? at[(bb * k + j) * m + i] : a[(bb * m + i) * k + j];
                        acc += av * dy[(bb * m + i) * n + l];
                    }
                    mexc_sink_put(&sink, idx, 0u, acc);
                }
    }
}

/* ------------------------------------------------------------------ scale by a constant */

int32_t mexc_scale_forward(const int8_t *x, int32_t e, uint32_t n, mexc_fixed_t s, int8_t *y,
                           const mexc_ctx_t *ctx, uint32_t tid)
{
    uint32_t i;
    int32_t e_out = 0;
    mexc_sink_t sink;
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, e - s.shift);
        for (i = 0; i < n; i++) mexc_sink_put(&sink, i, 0u, (int32_t)x[i] * s.num);
    }
    return e_out;
}

/* ------------------------------------------------------------------ broadcast add */

int32_t mexc_add_broadcast_forward(const int8_t *x, int32_t ex, const int8_t *p, int32_t ep,
                                   uint32_t outer, uint32_t mid, uint32_t inner, int8_t *y,
                                   const mexc_ctx_t *ctx, uint32_t tid)
{
    const uint32_t k0 = mexc_site_key(ctx, tid, 0), k1 = mexc_site_key(ctx, tid, 1);
    int32_t e[2], b[2], t, e_out = 0;
    uint32_t o, m, i, idx;
    mexc_sink_t sink;
    e[0] = ex;
    e[1] = ep;
    b[0] = 7;
    b[1] = 7;
    t = mexc_aligned_target(2u, e, b);
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 2), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, t);
        for (idx = 0, o = 0; o < outer; o++)
            for (m = 0; m < mid; m++)
                for (i = 0; i < inner; i++, idx++)
                    mexc_sink_put(&sink, idx, 0u,
                                  mexc_shift_signed(x[idx], t - ex, ctx->stochastic, k0, idx) +
                                      mexc_shift_signed(p[m], t - ep, ctx->stochastic, k1, m));
    }
    return e_out;
}

/* ------------------------------------------------------------------ data movement */

void mexc_transpose(const int8_t *x, int8_t *y, uint32_t ndim, const uint32_t *shape,
                    const uint32_t *perm)
{
    uint32_t in_stride[MEXC_MAX_DIMS], out_shape[MEXC_MAX_DIMS], step[MEXC_MAX_DIMS];
    uint32_t cnt[MEXC_MAX_DIMS], total = 1u, i, src = 0, o;
    int32_t dd;
    for (dd = (int32_t)ndim - 1; dd >= 0; dd--) {
        in_stride[dd] = total;
        total *= shape[dd];
    }
    for (i = 0; i < ndim; i++) {
        out_shape[i] = shape[perm[i]];
        step[i] = in_stride[perm[i]];
        cnt[i] = 0;
    }
    for (o = 0; o < total; o++) {
        y[o] = x[src];
        for (dd = (int32_t)ndim - 1; dd >= 0; dd--) { /* odometer over the output coordinates */
            src += step[dd];
            if (++cnt[dd] < out_shape[dd]) break;
            src -= step[dd] * out_shape[dd];
            cnt[dd] = 0;
        }
    }
}

void mexc_slice_forward(uint32_t outer, uint32_t dim_in, uint32_t start, uint32_t dim_out,
                        uint32_t inner, const int8_t *x, int8_t *y)
{
    uint32_t o, j, i;
    for (o = 0; o < outer; o++)
        for (j = 0; j < dim_out; j++)
            for (i = 0; i < inner; i++)
                y[(o * dim_out + j) * inner + i] = x[(o * dim_in + start + j) * inner + i];
}

void mexc_slice_backward(uint32_t outer, uint32_t dim_in, uint32_t start, uint32_t dim_out,
                         uint32_t inner, const int8_t *dy, int8_t *dx)
{
    uint32_t o, j, i;
    for (i = 0; i < outer * dim_in * inner; i++) dx[i] = 0;
    for (o = 0; o < outer; o++)
        for (j = 0; j < dim_out; j++)
            for (i = 0; i < inner; i++)
                dx[(o * dim_in + start + j) * inner + i] = dy[(o * dim_out + j) * inner + i];
}
