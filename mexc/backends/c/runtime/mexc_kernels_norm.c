/* Batch normalization: the C form of mexc/kernels/norm.py (docs/layers.md, BatchNorm).
 * x is viewed as (N, C, S); the flat element index is (n*C + c)*S + s, as numpy's. */
#include "mexc_kernels.h"

#define RSTD_NUM_LOG2 29
#define EPS_BITS 30

/* norm._rstd for one channel or row: 1/sqrt(var * 2^ev + eps) as rstd in [2^14, 2^15] at
 * *rstd_e (var <= 2^30). var + eps is summed at ev + k (norm.eps_rise), so that eps aligned
 * there stays exact and below 2^30 when it dominates the variance. */
int32_t mexc_rstd(int32_t var, int32_t ev, mexc_fixed_t eps, int32_t *rstd_e)
{
    int32_t sh = -eps.shift - ev, k = 0, n0, t;
    uint32_t sigma;
    if (eps.num > 0) {
        k = mexc_bit_length((uint32_t)eps.num) + sh - EPS_BITS;
        if (k < 0) k = 0;
    }
    n0 = mexc_shift_right(var, k, 0, 0u, 0u)
         + (sh >= 0 ? mexc_shift_left(eps.num, sh - k) : mexc_shift_right(eps.num, -sh, 0, 0u, 0u));
    if (n0 < 1) n0 = 1;
    ev += k;
    t = 29 - mexc_bit_length((uint32_t)n0);
    if ((ev - t) & 1) t++;
    sigma = mexc_isqrt32((uint32_t)mexc_shift_signed(n0, -t, 0, 0u, 0u));
    *rstd_e = -RSTD_NUM_LOG2 - (ev - t) / 2;
    return mexc_idiv_round((int32_t)1 << RSTD_NUM_LOG2, sigma);
}

/* norm._affine: y = compact(aligned_sum(gamma*xhat, beta)); sites j, j+1, j+2. y may alias
 * xhat (each element is read before it is written). */
static int32_t bn_affine(uint32_t n, uint32_t c, uint32_t s, const int8_t *xhat, int32_t exh,
                         const int8_t *gamma, int32_t eg, const int8_t *beta, int32_t eb,
                         int8_t *y, const mexc_ctx_t *ctx, uint32_t tid, uint32_t j)
{
    const uint32_t k1 = mexc_site_key(ctx, tid, j), k2 = mexc_site_key(ctx, tid, j + 1u);
    int32_t e[2], b[2], t, v, e_out = 0;
    uint32_t nn, cc, i, idx;
    mexc_sink_t sink;
    e[0] = exh + eg;
    e[1] = eb;
    b[0] = 14;
    b[1] = 7;
    t = mexc_aligned_target(2u, e, b);
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, j + 2u), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, t);
        idx = 0;
        for (nn = 0; nn < n; nn++)
            for (cc = 0; cc < c; cc++)
                for (i = 0; i < s; i++, idx++) {
                    v = mexc_shift_signed((int32_t)xhat[idx] * gamma[cc], t - e[0],
                                          ctx->stochastic, k1, idx) +
                        mexc_shift_signed(beta[cc], t - eb, ctx->stochastic, k2, cc);
                    mexc_sink_put(&sink, idx, 0u, v);
                }
    }
    return e_out;
}

/* ------------------------------------------------------------------ forward_train */

/* Per channel: mean, variance pre-shift r, variance, rstd (steps 1-4 of the recipe). */
static void bn_stats(uint32_t n, uint32_t c, uint32_t s, const int8_t *x, int32_t f,
                     mexc_bn_saved_t *sv, int32_t *r, mexc_fixed_t eps, int32_t e_c,
                     const mexc_ctx_t *ctx, uint32_t key0)
{
    const uint32_t m = n * s, lim = 0x7FFFFFFFu / m;
    uint32_t cc, nn, i, idx, amax, a, top, vsum;
    int32_t ssum, mu, xc, tq, shv, vnum;
    for (cc = 0; cc < c; cc++) {
        ssum = 0;
        for (nn = 0; nn < n; nn++)
            for (i = 0; i < s; i++) ssum += x[(nn * c + cc) * s + i];
        mu = mexc_idiv_round(mexc_shift_left(ssum, f), m);
        amax = 0;
        for (nn = 0; nn < n; nn++)
            for (i = 0; i < s; i++) {
                a = mexc_uabs(mexc_shift_left(x[(nn * c + cc) * s + i], f) - mu);
                amax = a > amax ? a : amax;
            }
        r[cc] = 0; /* smallest r with M * ceil(amax / 2^r)^2 <= 2^31 - 1 */
        for (;;) {
            top = (amax + ((1u << r[cc]) - 1u)) >> r[cc];
            if (top * top <= lim) break;
            r[cc]++;
        }
        vsum = 0;
        for (nn = 0; nn < n; nn++)
            for (i = 0; i < s; i++) {
                idx = (nn * c + cc) * s + i;
                xc = mexc_shift_left(x[idx], f) - mu;
                tq = mexc_shift_right(xc, r[cc], ctx->stochastic, key0, idx);
                vsum += (uint32_t)(tq * tq);
            }
        shv = 30 - mexc_bit_length(vsum);
        shv = shv > 0 ? shv : 0;
        vnum = (int32_t)(vsum << shv);
        sv->mean[cc] = mu;
        sv->var[cc] = mexc_idiv_round(vnum, m);
        sv->var_u[cc] = mexc_idiv_round(vnum, m - 1u);
        sv->var_e[cc] = 2 * (e_c + r[cc]) - shv;
        sv->rstd[cc] = mexc_rstd(sv->var[cc], sv->var_e[cc], eps, &sv->rstd_e[cc]);
    }
}

int32_t mexc_batchnorm_forward_train(uint32_t n, uint32_t c, uint32_t s, const int8_t *x,
                                     int32_t ex, const int8_t *gamma, int32_t eg,
                                     const int8_t *beta, int32_t eb, mexc_fixed_t eps, int8_t *y,
                                     mexc_bn_saved_t *sv, const mexc_ctx_t *ctx, uint32_t tid,
                                     int32_t *scratch)
{
    const uint32_t m = n * s;
    int32_t *r = scratch, *cshift = scratch + c, *e_grp = scratch + 2u * c;
    uint32_t *camax = (uint32_t *)(scratch + 3u * c);
    int32_t f = 31 - (7 + mexc_ceil_log2(m)), e_c;
    uint32_t nn, cc, i, idx;
    mexc_sink_t sink;
    f = f < 8 ? f : 8; /* mean_frac_bits */
    e_c = ex - f;
    sv->count = m;
    sv->mean_e = e_c;
    bn_stats(n, c, s, x, f, sv, r, eps, e_c, ctx, mexc_site_key(ctx, tid, 0));
    /* xhat = compact_common(xc * rstd, e_c + rstd_e, axis 1) [1] */
    for (cc = 0; cc < c; cc++) e_grp[cc] = e_c + sv->rstd_e[cc];
    mexc_sink_init(&sink, sv->xhat, ctx, mexc_site_key(ctx, tid, 1), camax, cshift, c, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) sv->xhat_e = mexc_sink_finish_common(&sink, e_grp, c);
        idx = 0;
        for (nn = 0; nn < n; nn++)
            for (cc = 0; cc < c; cc++)
                for (i = 0; i < s; i++, idx++)
                    mexc_sink_put(&sink, idx, cc,
                                  (mexc_shift_left(x[idx], f) - sv->mean[cc]) * sv->rstd[cc]);
    }
    if (y == NULL) return 0; /* xhat alone (a copy for the backward pass): no affine */
    return bn_affine(n, c, s, sv->xhat, sv->xhat_e, gamma, eg, beta, eb, y, ctx, tid, 2u);
}

int32_t mexc_batchnorm_affine(uint32_t n, uint32_t c, uint32_t s, const mexc_bn_saved_t *saved,
                              const int8_t *gamma, int32_t eg, const int8_t *beta, int32_t eb,
                              int8_t *y, const mexc_ctx_t *ctx, uint32_t tid)
{
    return bn_affine(n, c, s, saved->xhat, saved->xhat_e, gamma, eg, beta, eb, y, ctx, tid, 2u);
}

/* ------------------------------------------------------------------ backward */

/* T = aligned_sum(M*dy, -dbeta, -xhat*dg16) [1,2,3] (the 1/M is in the per-channel factor). */
static int32_t bn_bracket(int32_t d, int32_t db, int32_t xh, int32_t g16, uint32_t m,
                          const int32_t *sh, const uint32_t *keys, int32_t st, uint32_t idx,
                          uint32_t cc)
{
    return mexc_shift_signed(d * (int32_t)m, sh[0], st, keys[0], idx) +
           mexc_shift_signed(-db, sh[1], st, keys[1], cc) +
           mexc_shift_signed(-(xh * g16), sh[2], st, keys[2], idx);
}

void mexc_grad_dense(mexc_grad_src_t *g, const int8_t *dy)
{
    g->dense = dy;
    g->pooled = NULL;
    g->argmax = NULL;
}

int32_t mexc_grad_pooled(mexc_grad_src_t *g, const mexc_pool_t *p, const int8_t *pooled,
                         int32_t ed, const uint8_t *argmax, const mexc_ctx_t *ctx, uint32_t tid)
{
    uint32_t i, n = p->n * p->c * p->oh * p->ow, amax = 0u;
    g->dense = NULL;
    g->pooled = pooled;
    g->argmax = argmax;
    g->h = p->h;
    g->w = p->w;
    g->kh = p->kh;
    g->kw = p->kw;
    g->oh = p->oh;
    g->ow = p->ow;
    g->stoch = ctx->stochastic;
    g->bits = ctx->bits;
    g->key = mexc_site_key(ctx, tid, 0);
    /* each pooled value lands at one position, the others are 0: the same maximum */
    for (i = 0; i < n; i++)
        if (mexc_uabs(pooled[i]) > amax) amax = mexc_uabs(pooled[i]);
    if (ctx->chan) { /* channel exponents: |dy| <= 127 passes unrounded (maxpool's through) */
        g->bits = 8;
        amax = 0u;
    }
    g->s = mexc_compaction_shift(amax, g->bits);
    return ed + g->s;
}

/* Element i (flat NCHW index) of the gradient, plane = n * C + c its plane. */
static int32_t grad_at(const mexc_grad_src_t *g, uint32_t idx, uint32_t plane)
{
    uint32_t y, x, o;
    if (g->dense) return g->dense[idx];
    y = (idx - plane * g->h * g->w) / g->w;
    x = (idx - plane * g->h * g->w) - y * g->w;
    if (y / g->kh >= g->oh || x / g->kw >= g->ow) return 0; /* below or right of every window */
    o = (plane * g->oh + y / g->kh) * g->ow + x / g->kw;
    if (g->argmax[o] != (y % g->kh) * g->kw + x % g->kw) return 0;
    return mexc_saturate(mexc_shift_right(g->pooled[o], g->s, g->stoch, g->key, idx), g->bits);
}

void mexc_batchnorm_backward(uint32_t n, uint32_t c, uint32_t s, const int8_t *dy, int32_t ed,
                             const mexc_bn_saved_t *sv, const int8_t *gamma, int32_t eg,
                             int8_t *dx, int32_t *e_dx, int32_t *dgamma, int32_t *e_dgamma,
                             int32_t *dbeta, const mexc_ctx_t *ctx, uint32_t tid,
                             int32_t *scratch)
{
    mexc_grad_src_t g;
    mexc_grad_dense(&g, dy);
    mexc_batchnorm_backward_src(n, c, s, &g, ed, sv, gamma, eg, dx, e_dx, dgamma, e_dgamma, dbeta,
                                ctx, tid, scratch);
}

void mexc_batchnorm_backward_src(uint32_t n, uint32_t c, uint32_t s, const mexc_grad_src_t *dy,
                                 int32_t ed, const mexc_bn_saved_t *sv, const int8_t *gamma,
                                 int32_t eg, int8_t *dx, int32_t *e_dx, int32_t *dgamma,
                                 int32_t *e_dgamma, int32_t *dbeta, const mexc_ctx_t *ctx,
                                 uint32_t tid, int32_t *scratch)
{
    const uint32_t m = n * s, total = n * c * s;
    const int32_t st = ctx->stochastic;
    int32_t *dg16 = scratch, *f16 = scratch + c, *e_f = scratch + 2u * c;
    int32_t *cshift = scratch + 3u * c;
    uint32_t *camax = (uint32_t *)(scratch + 4u * c);
    const int8_t *dp = NULL; /* the dense gradient, pre-shifted where the cap needs it */
    int32_t edp = ed, s0, e[3], b[3], sh[3], target, bk, sbk = 0, fac, lsh, q, sf, e_bk;
    uint32_t keys[3], nn, cc, i, idx, bmax = 0;
    mexc_sink_t sink;
    for (cc = 0; cc < c; cc++) { /* bias_backward: dbeta = sum over N and S */
        int32_t acc = 0;
        for (nn = 0; nn < n; nn++)
            for (i = 0; i < s; i++) acc += grad_at(dy, (nn * c + cc) * s + i, nn * c + cc);
        dbeta[cc] = acc;
    }
    if (dy->dense) /* a pooled source comes only where the cap needs no pre-shift */
        dp = mexc_fit_product(dy->dense, total, &edp, m, ctx, mexc_site_key(ctx, tid, 7),
                              scratch + 5u * c);
    for (cc = 0; cc < c; cc++) {
        int32_t acc = 0;
        for (nn = 0; nn < n; nn++)
            for (i = 0; i < s; i++) {
                idx = (nn * c + cc) * s + i;
                acc += (dp ? dp[idx] : grad_at(dy, idx, nn * c + cc)) * sv->xhat[idx];
            }
        dgamma[cc] = acc;
    }
    *e_dgamma = edp + sv->xhat_e;
    s0 = mexc_compact_to_bits(dgamma, dg16, c, 15, st, mexc_site_key(ctx, tid, 0));
    e[0] = ed;
    e[1] = ed;
    e[2] = sv->xhat_e + *e_dgamma + s0;
    b[0] = 7 + mexc_ceil_log2(m);
    b[1] = b[0];
    b[2] = 7 + 15;
    target = mexc_aligned_target(3u, e, b);
    for (i = 0; i < 3u; i++) {
        sh[i] = target - e[i];
        keys[i] = mexc_site_key(ctx, tid, 1u + i);
    }
    if (dx == NULL) return; /* input gradient not needed (first layer): skip its passes */
    /* T16 = compact_to_bits(T, 15) [4]: scan max|T| */
    for (idx = 0, nn = 0; nn < n; nn++)
        for (cc = 0; cc < c; cc++)
            for (i = 0; i < s; i++, idx++) {
                bk = bn_bracket(grad_at(dy, idx, nn * c + cc), dbeta[cc], sv->xhat[idx], dg16[cc],
                                m, sh, keys, st, idx, cc);
                bmax = mexc_uabs(bk) > bmax ? mexc_uabs(bk) : bmax;
            }
    while ((uint64_t)bmax > ((uint64_t)1 << 15) << sbk) sbk++;
    e_bk = target + sbk;
    /* f16 = gamma * rstd / M shifted to 16 bits [5]: normalized to 2^30 by lsh, then divided */
    for (cc = 0; cc < c; cc++) {
        fac = (int32_t)gamma[cc] * sv->rstd[cc];
        lsh = 30 - mexc_bit_length(mexc_uabs(fac));
        q = mexc_idiv_round(mexc_shift_left(fac, lsh), m);
        sf = mexc_bit_length(mexc_uabs(q)) - 15;
        sf = sf > 0 ? sf : 0;
        f16[cc] = mexc_shift_right(q, sf, st, mexc_site_key(ctx, tid, 5), cc);
        e_f[cc] = e_bk + eg + sv->rstd_e[cc] - lsh + sf;
    }
    /* dx = compact_common(bk16 * f16, e_bk + e_f, axis 1) [6]; dx may be dy's or xhat's bytes:
     * each element is read before it is written */
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 6), camax, cshift, c, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) *e_dx = mexc_sink_finish_common(&sink, e_f, c);
        for (idx = 0, nn = 0; nn < n; nn++)
            for (cc = 0; cc < c; cc++)
                for (i = 0; i < s; i++, idx++) {
                    bk = bn_bracket(grad_at(dy, idx, nn * c + cc), dbeta[cc], sv->xhat[idx],
                                    dg16[cc], m, sh, keys, st, idx, cc);
                    bk = mexc_shift_right(bk, sbk, st, mexc_site_key(ctx, tid, 4), idx);
                    mexc_sink_put(&sink, idx, cc, bk * f16[cc]);
                }
    }
}

/* ------------------------------------------------------------------ running statistics */

/* norm._ema: r <- (1 - mom) r + mom b. b (C) with exponents b_e (C if b_grouped else 1). */
static void bn_ema(uint32_t c, int8_t *r, int32_t *r_e, int32_t r_grouped, const int32_t *b,
                   const int32_t *b_e, int32_t b_grouped, mexc_fixed_t mom,
                   const mexc_ctx_t *ctx, uint32_t tid, uint32_t j, int32_t *scratch)
{
    int32_t *b16 = scratch, *acc = scratch + c, *t = scratch + 2u * c;
    const int32_t one_minus = (int32_t)(1u << mom.shift) - mom.num, st = ctx->stochastic;
    const uint32_t k1 = mexc_site_key(ctx, tid, j + 1u), k2 = mexc_site_key(ctx, tid, j + 2u);
    const uint32_t k3 = mexc_site_key(ctx, tid, j + 3u);
    int32_t sb, e[2], bb[2], er, eb2;
    uint32_t cc;
    sb = mexc_compact_to_bits(b, b16, c, 15, st, mexc_site_key(ctx, tid, j));
    bb[0] = 7 + mexc_bit_length((uint32_t)one_minus);
    bb[1] = 15 + mexc_bit_length((uint32_t)mom.num);
    for (cc = 0; cc < c; cc++) {
        er = r_e[r_grouped ? cc : 0u] - mom.shift;
        eb2 = b_e[b_grouped ? cc : 0u] + sb - mom.shift;
        e[0] = er;
        e[1] = eb2;
        t[cc] = mexc_aligned_target(2u, e, bb);
        acc[cc] = mexc_shift_signed((int32_t)r[cc] * one_minus, t[cc] - er, st, k1, cc) +
                  mexc_shift_signed(b16[cc] * mom.num, t[cc] - eb2, st, k2, cc);
    }
    if (r_grouped) { /* numerics.compact(grouped=True), one element per group */
        mexc_compact_grouped(acc, r, c, 1u, t, r_e, ctx->bits, st, k3);
    } else if (!b_grouped) { /* one exponent: compact per tensor */
        r_e[0] = mexc_compact(acc, r, c, t[0], ctx->bits, st, k3);
    } else { /* compact_common along axis 0 */
        mexc_sink_t sink;
        int32_t *cshift = b16; /* b16 is no longer needed */
        uint32_t *camax = (uint32_t *)(scratch + 3u * c);
        mexc_sink_init(&sink, r, ctx, k3, camax, cshift, c, -1);
        for (cc = 0; cc < c; cc++) mexc_sink_put(&sink, cc, cc, acc[cc]);
        r_e[0] = mexc_sink_finish_common(&sink, t, c);
        for (cc = 0; cc < c; cc++) mexc_sink_put(&sink, cc, cc, acc[cc]);
    }
}

void mexc_batchnorm_update_running(uint32_t c, int8_t *rm, int32_t *rm_e, int32_t rm_grouped,
                                   int8_t *rv, int32_t *rv_e, int32_t rv_grouped,
                                   const mexc_bn_saved_t *sv, mexc_fixed_t momentum,
                                   const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    bn_ema(c, rm, rm_e, rm_grouped, sv->mean, &sv->mean_e, 0, momentum, ctx, tid, 0u, scratch);
    bn_ema(c, rv, rv_e, rv_grouped, sv->var_u, sv->var_e, 1, momentum, ctx, tid, 4u, scratch);
}

/* ------------------------------------------------------------------ forward_eval */

int32_t mexc_batchnorm_forward_eval(uint32_t n, uint32_t c, uint32_t s, const int8_t *x,
                                    int32_t ex, const int8_t *gamma, int32_t eg,
                                    const int8_t *beta, int32_t eb, const int8_t *rm,
                                    const int32_t *rm_e, int32_t rm_grouped, const int8_t *rv,
                                    const int32_t *rv_e, int32_t rv_grouped, mexc_fixed_t eps,
                                    int8_t *y, const mexc_ctx_t *ctx, uint32_t tid,
                                    int32_t *scratch)
{
    int32_t *tg = scratch, *sx = scratch + c, *rstd = scratch + 2u * c;
    int32_t *e16 = scratch + 3u * c, *cshift = scratch + 4u * c;
    uint32_t *camax = (uint32_t *)(scratch + 5u * c);
    const uint32_t k0 = mexc_site_key(ctx, tid, 0), k1 = mexc_site_key(ctx, tid, 1);
    const uint32_t k2 = mexc_site_key(ctx, tid, 2);
    const int32_t st = ctx->stochastic;
    int32_t e[2], b[2], erm, xc, re, exh = 0;
    uint32_t nn, cc, i, idx;
    mexc_sink_t sink;
    b[0] = 7;
    b[1] = 7;
    for (cc = 0; cc < c; cc++) {
        e[0] = ex;
        e[1] = rm_e[rm_grouped ? cc : 0u];
        tg[cc] = mexc_aligned_target(2u, e, b);
        camax[cc] = 0;
    }
#define BN_XC(idx, cc)                                                                           \
    (mexc_shift_signed(x[idx], tg[cc] - ex, st, k0, idx) +                                     \
     mexc_shift_signed(-(int32_t)rm[cc], tg[cc] - rm_e[rm_grouped ? cc : 0u], st, k1, cc))
    for (idx = 0, nn = 0; nn < n; nn++)
        for (cc = 0; cc < c; cc++)
            for (i = 0; i < s; i++, idx++) {
                xc = (int32_t)mexc_uabs(BN_XC(idx, cc));
                camax[cc] = (uint32_t)xc > camax[cc] ? (uint32_t)xc : camax[cc];
            }
    for (cc = 0; cc < c; cc++) {
        erm = mexc_bit_length(camax[cc]) - 15;
        sx[cc] = erm > 0 ? erm : 0;
        rstd[cc] = mexc_rstd(rv[cc], rv_e[rv_grouped ? cc : 0u], eps, &re);
        e16[cc] = tg[cc] + sx[cc] + re;
    }
    /* xhat (written into y) = compact_common(xc16 * rstd, e16 + rstd_e, axis 1) [3] */
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 3), camax, cshift, c, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) exh = mexc_sink_finish_common(&sink, e16, c);
        for (idx = 0, nn = 0; nn < n; nn++)
            for (cc = 0; cc < c; cc++)
                for (i = 0; i < s; i++, idx++)
                    mexc_sink_put(&sink, idx, cc,
                                  mexc_shift_right(BN_XC(idx, cc), sx[cc], st, k2, idx) * rstd[cc]);
    }
#undef BN_XC
    return bn_affine(n, c, s, y, exh, gamma, eg, beta, eb, y, ctx, tid, 4u);
}
