/* ReLU6, LeakyReLU, Hardswish, average pooling, global average pooling, nearest upsampling and
 * dropout: the C form of
 * mexc/kernels/activation.py (relu6, leaky_relu, hardswish), pool.py (avgpool2d, global_avgpool,
 * upsample_nearest) and elementwise.py
 * (dropout). Flat element indices and rounding sites as the numpy kernels. */
#include "mexc_kernels.h"

/* ------------------------------------------------------------------ relu6 (activation.py) */

int32_t mexc_relu6_cap(int32_t e) /* activation.relu6_cap(e, 127) */
{
    if (e >= 0) return e >= 3 ? 0 : 6 >> e;
    return -e >= 5 ? 127 : 6 << -e; /* 6 << 5 = 192 > 127 */
}

void mexc_relu6_forward(const int8_t *x, int32_t e, int8_t *y, uint32_t n)
{
    const int32_t cap = mexc_relu6_cap(e);
    uint32_t i;
    int32_t v;
    for (i = 0; i < n; i++) {
        v = x[i];
        y[i] = (int8_t)(v < 0 ? 0 : (v > cap ? cap : v));
    }
}

void mexc_relu6_backward(const int8_t *dy, const int8_t *x, int32_t e, int8_t *dx, uint32_t n)
{
    /* keep where m > 0 and m 2^max(e,0) < 6 2^max(-e,0), both shifts capped at 8 */
    const int32_t sl = e > 0 ? (e < 8 ? e : 8) : 0, sr = e < 0 ? (-e < 8 ? -e : 8) : 0;
    const int32_t lim = 6 << sr;
    uint32_t i;
    int32_t m;
    for (i = 0; i < n; i++) {
        m = x[i];
        dx[i] = (m > 0 && (m << sl) < lim) ? dy[i] : 0;
    }
}

/* ------------------------------------------------------------------ clamp (activation.py) */

/* activation.bound_mantissa: floor (ceil) of num 2^(-shift - e), the left shift saturating at
 * 2^16 (past every int8 mantissa), the right shift at most 31 */
static int32_t clamp_bound_at(int32_t num, int32_t shift, int32_t e, int32_t ceil)
{
    const int32_t t = -shift - e;
    int32_t k;
    if (t >= 0) return num * ((int32_t)1 << (t < 16 ? t : 16));
    k = -t < 31 ? -t : 31;
    return ceil ? -((-num) >> k) : num >> k;
}

void mexc_clamp_forward(const int8_t *x, int32_t e, uint32_t n, const int32_t *bounds,
                        int32_t top, int8_t *y)
{
    /* bounds: has_lo, lo_num, lo_shift, has_hi, hi_num, hi_shift */
    int32_t lo = -top - 1, hi = top, v;
    uint32_t i;
    if (bounds[0]) {
        lo = clamp_bound_at(bounds[1], bounds[2], e, 1);
        lo = lo < top ? lo : top;
    }
    if (bounds[3]) {
        hi = clamp_bound_at(bounds[4], bounds[5], e, 0);
        hi = hi > -top ? hi : -top;
    }
    for (i = 0; i < n; i++) {
        v = x[i] > lo ? x[i] : lo;
        y[i] = (int8_t)(v < hi ? v : hi);
    }
}

void mexc_clamp_backward(const int8_t *dy, const int8_t *x, int32_t e, uint32_t n,
                         const int32_t *bounds, int8_t *dx)
{
    /* lo < x < hi strictly: m > floor(lo / 2^e), m < ceil(hi / 2^e) */
    const int32_t lo = bounds[0] ? clamp_bound_at(bounds[1], bounds[2], e, 0) : 0;
    const int32_t hi = bounds[3] ? clamp_bound_at(bounds[4], bounds[5], e, 1) : 0;
    int32_t m, keep;
    uint32_t i;
    for (i = 0; i < n; i++) {
        m = x[i];
        keep = (!bounds[0] || m > lo) && (!bounds[3] || m < hi);
        dx[i] = keep ? dy[i] : 0;
    }
}

/* ------------------------------------------------------------------ pool._divide */

/* acc * 2^e / count for a sum bounded by 2^bound_bits: the exact left shift (bound <= 15) or the
 * per-tensor compact_to_bits(., 15) [site 0], then div_const. A pass 0 over the sums finds the
 * compact_to_bits shift (amax is the scanned max |acc|). */
typedef struct {
    int32_t left;   /* 1: exact left shift by sl; 0: rounded right shift by s0 */
    int32_t sl, s0; /* shifts */
    int32_t stoch;
    uint32_t key0;
    mexc_recip_t r;
} pool_div_t;

static int32_t pool_div_init(pool_div_t *d, int32_t bound_bits, uint32_t count, uint32_t amax,
                             int32_t e, const mexc_ctx_t *ctx, uint32_t tid)
{
    int32_t ea;
    d->left = bound_bits <= 15;
    d->sl = d->left ? 15 - bound_bits : 0;
    d->s0 = 0;
    if (!d->left)
        while ((uint64_t)amax > ((uint64_t)1 << 15) << d->s0) d->s0++;
    d->stoch = ctx->stochastic;
    d->key0 = mexc_site_key(ctx, tid, 0);
    d->r = mexc_recip_of(count);
    ea = d->left ? e - d->sl : e + d->s0;
    return ea - (int32_t)d->r.pow2;
}

static int32_t pool_div(const pool_div_t *d, int32_t acc, uint32_t idx)
{
    int32_t a = d->left ? mexc_shift_left(acc, d->sl)
                        : mexc_shift_right(acc, d->s0, d->stoch, d->key0, idx);
    return mexc_div_const(a, &d->r);
}

/* ------------------------------------------------------------------ hardswish (activation.py) */

#define HS_GRID 16

static int32_t hs_k(int32_t e) { return e >= 0 ? 0 : (-e < HS_GRID ? -e : HS_GRID); }

/* the input on the 2^-k grid: m << min(k + e, 3), or nearest m >> -(k + e) below 2^-16 */
static int32_t hs_grid(int32_t m, int32_t e, int32_t k)
{
    const int32_t s = k + e;
    if (s >= 0) return m * (1 << (s < 3 ? s : 3));
    return mexc_shift_right(m, -s, 0, 0u, 0u);
}

/* acc(i) of the forward (a = x) or the backward (a = dy, b = x); e: x's exponent */
typedef int32_t (*hs_acc_fn)(const int8_t *a, const int8_t *b, uint32_t i, int32_t e, int32_t k,
                             int32_t left);

static int32_t hs_forward_acc(const int8_t *x, const int8_t *unused, uint32_t i, int32_t e,
                              int32_t k, int32_t left)
{
    const int32_t three = 3 << k, m = x[i];
    int32_t c = hs_grid(m, e, k) + three;
    (void)unused;
    c = c < 0 ? 0 : (c > 2 * three ? 2 * three : c);
    return mexc_shift_left(m * c, left);
}

static int32_t hs_backward_acc(const int8_t *dy, const int8_t *x, uint32_t i, int32_t e,
                               int32_t k, int32_t left)
{
    const int32_t three = 3 << k, xk = hs_grid(x[i], e, k);
    const int32_t g = xk <= -three ? 0 : (xk >= three ? 2 * three : 2 * xk + three);
    return mexc_shift_left(dy[i] * g, left);
}

#define HSIG_BITS 12     /* activation.HSIG_BITS */
#define HSIG_GRAD_LEFT 8 /* activation.HSIG_GRAD_LEFT */

static int32_t hsig_forward_acc(const int8_t *x, const int8_t *unused, uint32_t i, int32_t e,
                                int32_t k, int32_t left)
{
    const int32_t three = 3 << k;
    int32_t c = hs_grid(x[i], e, k) + three;
    (void)unused;
    c = c < 0 ? 0 : (c > 2 * three ? 2 * three : c);
    return mexc_shift_left(c, left);
}

static int32_t hsig_backward_acc(const int8_t *dy, const int8_t *x, uint32_t i, int32_t e,
                                 int32_t k, int32_t left)
{
    const int32_t three = 3 << k, xk = hs_grid(x[i], e, k);
    return xk > -three && xk < three ? mexc_shift_left(dy[i], left) : 0;
}

/* _divide_by_six over acc(i) 2^ea in three passes: max |acc|; then div_const of the 15-bit
 * compaction (site 0), scanned and written by the output compaction (site 1) */
static int32_t hs_divide(hs_acc_fn f, const int8_t *a, const int8_t *b, int32_t e, int32_t left,
                         int32_t ea, uint32_t n, int8_t *out, const mexc_ctx_t *ctx, uint32_t tid)
{
    const int32_t k = hs_k(e);
    uint32_t i, amax = 0, mag;
    int32_t pass, acc, eq = 0, e_out = 0;
    pool_div_t d;
    mexc_sink_t sink;
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, 1), NULL, NULL, 0u, 0);
    for (pass = 0; pass < 3; pass++) {
        if (pass == 1) eq = pool_div_init(&d, 16, 6u, amax, ea, ctx, tid);
        if (pass == 2) e_out = mexc_sink_finish(&sink, eq);
        for (i = 0; i < n; i++) {
            acc = f(a, b, i, e, k, left);
            if (pass == 0) {
                mag = mexc_uabs(acc);
                amax = mag > amax ? mag : amax;
            } else {
                mexc_sink_put(&sink, i, 0u, pool_div(&d, acc, i));
            }
        }
    }
    return e_out;
}

int32_t mexc_hardswish_forward(const int8_t *x, int32_t e, uint32_t n, int8_t *y,
                               const mexc_ctx_t *ctx, uint32_t tid)
{
    const int32_t k = hs_k(e), left = k < 5 ? 5 - k : 0;
    return hs_divide(hs_forward_acc, x, x, e, left, e - k - left, n, y, ctx, tid);
}

int32_t mexc_hardswish_backward(const int8_t *dy, int32_t ed, const int8_t *x, int32_t e,
                                uint32_t n, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid)
{
    const int32_t k = hs_k(e), left = k < 4 ? 4 - k : 0;
    return hs_divide(hs_backward_acc, dy, x, e, left, ed - k - left, n, dx, ctx, tid);
}

int32_t mexc_hardsigmoid_forward(const int8_t *x, int32_t e, uint32_t n, int8_t *y,
                                 const mexc_ctx_t *ctx, uint32_t tid)
{
    const int32_t k = hs_k(e), left = k < HSIG_BITS ? HSIG_BITS - k : 0;
    return hs_divide(hsig_forward_acc, x, x, e, left, -k - left, n, y, ctx, tid);
}

int32_t mexc_hardsigmoid_backward(const int8_t *dy, int32_t ed, const int8_t *x, int32_t e,
                                  uint32_t n, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid)
{
    return hs_divide(hsig_backward_acc, dy, x, e, HSIG_GRAD_LEFT, ed - HSIG_GRAD_LEFT, n, dx, ctx,
                     tid);
}

/* ------------------------------------------------------------------ leaky relu (activation.py) */

int32_t mexc_leaky_relu(const int8_t *x, int32_t e, const int8_t *mask, uint32_t n, int32_t num,
                        int32_t shift, int8_t *y, const mexc_ctx_t *ctx, uint32_t tid)
{
    /* m 2^shift where mask > 0, m num elsewhere: |.| < 2^30 (shift <= 23, |num| < 2^15) */
    const int32_t pos = (int32_t)1 << shift;
    int32_t e_out = 0;
    uint32_t i;
    mexc_sink_t sink;
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, e - shift);
        for (i = 0; i < n; i++) mexc_sink_put(&sink, i, 0u, (int32_t)x[i] * (mask[i] > 0 ? pos : num));
    }
    return e_out;
}

/* ------------------------------------------------------------------ avgpool2d (pool.py) */

static int32_t avg_window(const mexc_pool_t *p, const int8_t *xp, uint32_t oy, uint32_t ox)
{
    uint32_t i, j;
    int32_t iy, ix, acc = 0;
    for (i = 0; i < p->kh; i++) {
        iy = (int32_t)(oy * p->sh + i) - (int32_t)p->ph;
        if (iy < 0 || iy >= (int32_t)p->h) continue;
        for (j = 0; j < p->kw; j++) {
            ix = (int32_t)(ox * p->sw + j) - (int32_t)p->pw;
            if (ix < 0 || ix >= (int32_t)p->w) continue;
            acc += xp[(uint32_t)iy * p->w + (uint32_t)ix];
        }
    }
    return acc;
}

int32_t mexc_avgpool2d_forward(const mexc_pool_t *p, const int8_t *x, int32_t e, int8_t *y,
                               const mexc_ctx_t *ctx, uint32_t tid)
{
    const uint32_t kk = p->kh * p->kw, planes = p->n * p->c;
    const int32_t bound = 7 + mexc_ceil_log2(kk);
    uint32_t plane, oy, ox, idx, amax = 0, a;
    int32_t eq = 0, e_out = 0, pass;
    pool_div_t d;
    mexc_sink_t sink;
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 1), NULL, NULL, 0u, 0);
    for (pass = bound <= 15 ? 1 : 0; pass < 3; pass++) {
        if (pass == 1) eq = pool_div_init(&d, bound, kk, amax, e, ctx, tid);
        if (pass == 2) e_out = mexc_sink_finish(&sink, eq);
        idx = 0;
        for (plane = 0; plane < planes; plane++)
            for (oy = 0; oy < p->oh; oy++)
                for (ox = 0; ox < p->ow; ox++, idx++) {
                    int32_t acc = avg_window(p, x + plane * p->h * p->w, oy, ox);
                    if (pass == 0) {
                        a = mexc_uabs(acc);
                        amax = a > amax ? a : amax;
                    } else {
                        mexc_sink_put(&sink, idx, 0u, pool_div(&d, acc, idx));
                    }
                }
    }
    return e_out;
}

/* g = div_const(dy << 8, KH*KW) (exact, exponent e - 8 - pow2) */
static int32_t avg_grad(int32_t dy, const mexc_recip_t *r)
{
    return mexc_div_const(mexc_shift_left(dy, 8), r);
}

int32_t mexc_avgpool2d_backward(const mexc_pool_t *p, const int8_t *dy, int32_t ed, int8_t *dx,
                                const mexc_ctx_t *ctx, uint32_t tid)
{
    const mexc_recip_t r = mexc_recip_of(p->kh * p->kw);
    const int32_t eg = ed - 8 - (int32_t)r.pow2;
    uint32_t plane, yy, xx, i, j, idx, o;
    int32_t acc, oy, ox, e_out = 0, ty, tx;
    mexc_sink_t sink;
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, eg);
        idx = 0;
        for (plane = 0; plane < p->n * p->c; plane++)
            for (yy = 0; yy < p->h; yy++)
                for (xx = 0; xx < p->w; xx++, idx++) {
                    acc = 0;
                    for (i = 0; i < p->kh; i++) {
                        ty = (int32_t)(yy + p->ph) - (int32_t)i;
                        if (ty < 0 || (uint32_t)ty % p->sh) continue;
                        oy = (int32_t)((uint32_t)ty / p->sh);
                        if ((uint32_t)oy >= p->oh) continue;
                        for (j = 0; j < p->kw; j++) {
                            tx = (int32_t)(xx + p->pw) - (int32_t)j;
                            if (tx < 0 || (uint32_t)tx % p->sw) continue;
                            ox = (int32_t)((uint32_t)tx / p->sw);
                            if ((uint32_t)ox >= p->ow) continue;
                            o = (plane * p->oh + (uint32_t)oy) * p->ow + (uint32_t)ox;
                            acc += avg_grad(dy[o], &r);
                        }
                    }
                    mexc_sink_put(&sink, idx, 0u, acc);
                }
    }
    return e_out;
}

/* ------------------------------------------------------------------ mean over an axis */

int32_t mexc_mean_axis_forward(uint32_t outer, uint32_t t, uint32_t inner, const int8_t *x,
                               int32_t e, int8_t *y, const mexc_ctx_t *ctx, uint32_t tid)
{
    const int32_t bound = 7 + mexc_ceil_log2(t);
    uint32_t o, i, k, idx, amax = 0, a;
    int32_t eq = 0, e_out = 0, pass, acc;
    pool_div_t d;
    mexc_sink_t sink;
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 1), NULL, NULL, 0u, 0);
    for (pass = bound <= 15 ? 1 : 0; pass < 3; pass++) {
        if (pass == 1) eq = pool_div_init(&d, bound, t, amax, e, ctx, tid);
        if (pass == 2) e_out = mexc_sink_finish(&sink, eq);
        idx = 0;
        for (o = 0; o < outer; o++)
            for (i = 0; i < inner; i++, idx++) {
                acc = 0;
                for (k = 0; k < t; k++) acc += x[(o * t + k) * inner + i];
                if (pass == 0) {
                    a = mexc_uabs(acc);
                    amax = a > amax ? a : amax;
                } else {
                    mexc_sink_put(&sink, idx, 0u, pool_div(&d, acc, idx));
                }
            }
    }
    return e_out;
}

int32_t mexc_mean_axis_backward(uint32_t outer, uint32_t t, uint32_t inner, const int8_t *dy,
                                int32_t ed, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid)
{
    const mexc_recip_t r = mexc_recip_of(t);
    const int32_t eg = ed - 8 - (int32_t)r.pow2;
    uint32_t o, k, i, idx;
    int32_t e_out = 0;
    mexc_sink_t sink;
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, eg);
        idx = 0;
        for (o = 0; o < outer; o++)
            for (k = 0; k < t; k++)
                for (i = 0; i < inner; i++, idx++)
                    mexc_sink_put(&sink, idx, 0u,
                                  mexc_div_const(mexc_shift_left(dy[o * inner + i], 8), &r));
    }
    return e_out;
}

int32_t mexc_global_avgpool_forward(uint32_t n, uint32_t c, uint32_t s, const int8_t *x,
                                    int32_t e, int8_t *y, const mexc_ctx_t *ctx, uint32_t tid)
{
    return mexc_mean_axis_forward(n * c, s, 1u, x, e, y, ctx, tid);
}

int32_t mexc_global_avgpool_backward(uint32_t n, uint32_t c, uint32_t s, const int8_t *dy,
                                     int32_t ed, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid)
{
    return mexc_mean_axis_backward(n * c, s, 1u, dy, ed, dx, ctx, tid);
}

/* ------------------------------------------------------------------ nearest upsampling (pool.py) */

void mexc_upsample_nearest_forward(uint32_t planes, uint32_t h, uint32_t w, uint32_t sh,
                                   uint32_t sw, const int8_t *x, int8_t *y)
{
    /* y in flat order, no division: every row of x written sh times, every pixel sw times */
    uint32_t p, i, a, j, b;
    const int8_t *row;
    for (p = 0; p < planes; p++)
        for (i = 0; i < h; i++) {
            row = x + (p * h + i) * w;
            for (a = 0; a < sh; a++)
                for (j = 0; j < w; j++)
                    for (b = 0; b < sw; b++) *y++ = row[j];
        }
}

int32_t mexc_upsample_nearest_backward(uint32_t planes, uint32_t h, uint32_t w, uint32_t sh,
                                       uint32_t sw, const int8_t *dy, int32_t ed, int8_t *dx,
                                       const mexc_ctx_t *ctx, uint32_t tid)
{
    /* dx[p, i, j] = sum of dy over its (sh, sw) block (|.| <= 128 sh sw), compaction site 0 */
    const uint32_t wide = w * sw;
    uint32_t p, i, j, a, b, idx;
    int32_t acc, e_out = 0;
    const int8_t *blk;
    mexc_sink_t sink;
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, ed);
        idx = 0;
        for (p = 0; p < planes; p++)
            for (i = 0; i < h; i++)
                for (j = 0; j < w; j++, idx++) {
                    blk = dy + (p * h * sh + i * sh) * wide + j * sw;
                    acc = 0;
                    for (a = 0; a < sh; a++)
                        for (b = 0; b < sw; b++) acc += blk[a * wide + b];
                    mexc_sink_put(&sink, idx, 0u, acc);
                }
    }
    return e_out;
}

/* ------------------------------------------------------------------ dropout (elementwise.py) */

static int32_t dropout_scaled(const int8_t *x, int32_t e, const uint8_t *mask, uint32_t n,
                              mexc_fixed_t s, int8_t *y, const mexc_ctx_t *ctx, uint32_t key)
{
    uint32_t i;
    int32_t e_out = 0;
    mexc_sink_t sink;
    mexc_sink_init(&sink, y, ctx, key, NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, e - s.shift);
        for (i = 0; i < n; i++) mexc_sink_put(&sink, i, 0u, mask[i] ? (int32_t)x[i] * s.num : 0);
    }
    return e_out;
}

int32_t mexc_dropout_forward(const int8_t *x, int32_t e, uint32_t n, uint32_t drop,
                             mexc_fixed_t scale, int8_t *y, uint8_t *mask, const mexc_ctx_t *ctx,
                             uint32_t tid, uint32_t per)
{
    const uint32_t k0 = mexc_site_key(ctx, tid, 0), keep_below = 0u - drop;
    uint32_t i;
    for (i = 0; i < n; i++)
        mask[i] = (uint8_t)(drop == 0u || mexc_rand(k0, i / per) < keep_below);
    return dropout_scaled(x, e, mask, n, scale, y, ctx, mexc_site_key(ctx, tid, 1));
}

int32_t mexc_dropout_backward(const int8_t *dy, int32_t ed, const uint8_t *mask, uint32_t n,
                              mexc_fixed_t scale, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid)
{
    return dropout_scaled(dy, ed, mask, n, scale, dx, ctx, mexc_site_key(ctx, tid, 0));
}
