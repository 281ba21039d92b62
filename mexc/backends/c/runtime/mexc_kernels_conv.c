/* Conv2d and linear kernels: the C form of mexc/kernels/conv.py and linear.py. */
#include "mexc_kernels.h"

/* ------------------------------------------------------------------ _common.fit_product */

int32_t mexc_product_cap(uint32_t k) { return 31 - (14 + mexc_ceil_log2(k)); }

int32_t mexc_product_bits(uint32_t k) { return 14 + mexc_ceil_log2(k ? k : 1u); }

uint32_t mexc_fit_scratch(uint32_t n, uint32_t k)
{
    return mexc_product_cap(k) < 0 ? (n + 3u) / 4u : 0u;
}

const int8_t *mexc_fit_product(const int8_t *a, uint32_t n, int32_t *e, uint32_t k,
                               const mexc_ctx_t *ctx, uint32_t key, int32_t *scratch)
{
    int32_t cap = mexc_product_cap(k);
    int8_t *out = (int8_t *)scratch;
    uint32_t i;
    if (cap >= 0) return a;
    for (i = 0; i < n; i++) out[i] = (int8_t)mexc_shift_right(a[i], -cap, ctx->stochastic, key, i);
    *e += -cap;
    return out;
}

/* ------------------------------------------------------------------ conv geometry */

void mexc_conv_init(mexc_conv_t *g, uint32_t n, uint32_t c, uint32_t h, uint32_t w, uint32_t o,
                    uint32_t kh, uint32_t kw, uint32_t sh, uint32_t sw, uint32_t ph, uint32_t pw,
                    uint32_t groups)
{
    g->n = n;
    g->c = c;
    g->h = h;
    g->w = w;
    g->o = o;
    g->kh = kh;
    g->kw = kw;
    g->sh = sh;
    g->sw = sw;
    g->ph = ph;
    g->pw = pw;
    g->groups = groups;
    g->oh = (h + 2u * ph - kh) / sh + 1u; /* conv._out_size */
    g->ow = (w + 2u * pw - kw) / sw + 1u;
}

/* Output row/column that input offset t = pos + pad - i maps to, or -1 (col2im gather). */
static int32_t out_pos(int32_t t, uint32_t stride, uint32_t limit)
{
    uint32_t q;
    if (t < 0) return -1;
    if (stride == 1u) return (uint32_t)t < limit ? t : -1;
    if ((uint32_t)t % stride) return -1;
    q = (uint32_t)t / stride;
    return q < limit ? (int32_t)q : -1;
}

/* ------------------------------------------------------------------ conv2d_forward */

/* Exact int32 sum of one output (n, o, oy, ox) of group grp (conv im2col @ w^T). */
static int32_t conv_acc(const mexc_conv_t *g, const int8_t *x, const int8_t *w, uint32_t nn,
                        uint32_t o, uint32_t grp, uint32_t oy, uint32_t ox)
{
    const uint32_t cg = g->c / g->groups;
    int32_t acc = 0, iy, ix;
    uint32_t cl, i, j;
    for (cl = 0; cl < cg; cl++) {
        const int8_t *xc = x + (nn * g->c + grp * cg + cl) * g->h * g->w;
        const int8_t *wc = w + (o * cg + cl) * g->kh * g->kw;
        for (i = 0; i < g->kh; i++) {
            iy = (int32_t)(oy * g->sh + i) - (int32_t)g->ph;
            if (iy < 0 || iy >= (int32_t)g->h) continue;
            for (j = 0; j < g->kw; j++) {
                ix = (int32_t)(ox * g->sw + j) - (int32_t)g->pw;
                if (ix < 0 || ix >= (int32_t)g->w) continue;
                acc += (int32_t)xc[(uint32_t)iy * g->w + (uint32_t)ix] * wc[i * g->kw + j];
            }
        }
    }
    return acc;
}

uint32_t mexc_conv2d_forward_scratch(const mexc_conv_t *g)
{
    return mexc_fit_scratch(g->n * g->c * g->h * g->w, g->c / g->groups * g->kh * g->kw);
}

int32_t mexc_conv2d_forward(const mexc_conv_t *g, const int8_t *x, int32_t ex, const int8_t *w,
                            int32_t ew, const int8_t *bias, int32_t eb, int8_t *y,
                            const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    const uint32_t k = g->c / g->groups * g->kh * g->kw, og = g->o / g->groups;
    uint32_t nn, o, oy, ox, idx, k1 = 0, k2 = 0;
    int32_t e_acc, e_out, t = 0, e[2], b[2], v;
    mexc_sink_t sink;
    x = mexc_fit_product(x, g->n * g->c * g->h * g->w, &ex, k, ctx, mexc_site_key(ctx, tid, 3),
                         scratch);
    e_acc = ex + ew;
    e_out = e_acc;
    if (bias) { /* linear.add_bias: aligned_sum([(acc, e, product_bits(K)), (b, eb, 7)]) */
        e[0] = e_acc;
        e[1] = eb;
        b[0] = mexc_product_bits(k);
        b[1] = 7;
        t = mexc_aligned_target(2u, e, b);
        e_out = t;
        k1 = mexc_site_key(ctx, tid, 1);
        k2 = mexc_site_key(ctx, tid, 2);
    }
    mexc_sink_init(&sink, y, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, bias ? t : e_acc);
        idx = 0;
        for (nn = 0; nn < g->n; nn++)
            for (o = 0; o < g->o; o++)
                for (oy = 0; oy < g->oh; oy++)
                    for (ox = 0; ox < g->ow; ox++, idx++) {
                        v = conv_acc(g, x, w, nn, o, o / og, oy, ox);
                        if (bias)
                            v = mexc_shift_signed(v, t - e_acc, ctx->stochastic, k1, idx) +
                                mexc_shift_signed(bias[o], t - eb, ctx->stochastic, k2, o);
                        mexc_sink_put(&sink, idx, 0u, v);
                    }
    }
    return e_out;
}

/* ------------------------------------------------------------------ conv2d_backward_input */

/* dx[nn, ci, y, xx] = sum over o in the group and kernel offsets of dy * w (col2im gather). */
static int32_t conv_dx_acc(const mexc_conv_t *g, const int8_t *dy, const int8_t *w, uint32_t nn,
                           uint32_t ci, uint32_t y, uint32_t xx)
{
    const uint32_t cg = g->c / g->groups, og = g->o / g->groups;
    const uint32_t grp = ci / cg, cl = ci - grp * cg;
    int32_t acc = 0, oy, ox;
    uint32_t ol, i, j, o;
    for (ol = 0; ol < og; ol++) {
        o = grp * og + ol;
        for (i = 0; i < g->kh; i++) {
            oy = out_pos((int32_t)(y + g->ph) - (int32_t)i, g->sh, g->oh);
            if (oy < 0) continue;
            for (j = 0; j < g->kw; j++) {
                ox = out_pos((int32_t)(xx + g->pw) - (int32_t)j, g->sw, g->ow);
                if (ox < 0) continue;
                acc += (int32_t)dy[((nn * g->o + o) * g->oh + (uint32_t)oy) * g->ow + (uint32_t)ox] *
                       w[((o * cg + cl) * g->kh + i) * g->kw + j];
            }
        }
    }
    return acc;
}

uint32_t mexc_conv2d_backward_input_scratch(const mexc_conv_t *g)
{
    return mexc_fit_scratch(g->n * g->o * g->oh * g->ow, g->o / g->groups * g->kh * g->kw);
}

int32_t mexc_conv2d_backward_input(const mexc_conv_t *g, const int8_t *dy, int32_t ed,
                                   const int8_t *w, int32_t ew, int8_t *dx, const mexc_ctx_t *ctx,
                                   uint32_t tid, int32_t *scratch)
{
    uint32_t nn, ci, y, xx, idx;
    int32_t e_out = 0;
    mexc_sink_t sink;
    dy = mexc_fit_product(dy, g->n * g->o * g->oh * g->ow, &ed, g->o / g->groups * g->kh * g->kw,
                          ctx, mexc_site_key(ctx, tid, 3), scratch);
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, ed + ew);
        idx = 0;
        for (nn = 0; nn < g->n; nn++)
            for (ci = 0; ci < g->c; ci++)
                for (y = 0; y < g->h; y++)
                    for (xx = 0; xx < g->w; xx++, idx++)
                        mexc_sink_put(&sink, idx, 0u, conv_dx_acc(g, dy, w, nn, ci, y, xx));
    }
    return e_out;
}

/* ------------------------------------------------------------------ conv2d_backward_weight */

uint32_t mexc_conv2d_backward_weight_scratch(const mexc_conv_t *g)
{
    return mexc_fit_scratch(g->n * g->o * g->oh * g->ow, g->n * g->oh * g->ow);
}

int32_t mexc_conv2d_backward_weight(const mexc_conv_t *g, const int8_t *dy, int32_t ed,
                                    const int8_t *x, int32_t ex, int32_t *dw,
                                    const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    const uint32_t cg = g->c / g->groups, og = g->o / g->groups, hw = g->oh * g->ow;
    uint32_t o, cl, i, j, nn, oy, ox;
    int32_t acc, iy, ix;
    dy = mexc_fit_product(dy, g->n * g->o * hw, &ed, g->n * hw, ctx, mexc_site_key(ctx, tid, 3),
                          scratch);
    for (o = 0; o < g->o; o++)
        for (cl = 0; cl < cg; cl++) {
            const uint32_t ci = (o / og) * cg + cl;
            for (i = 0; i < g->kh; i++)
                for (j = 0; j < g->kw; j++) {
                    acc = 0;
                    for (nn = 0; nn < g->n; nn++) {
                        const int8_t *d = dy + (nn * g->o + o) * hw;
                        const int8_t *xc = x + (nn * g->c + ci) * g->h * g->w;
                        for (oy = 0; oy < g->oh; oy++) {
                            iy = (int32_t)(oy * g->sh + i) - (int32_t)g->ph;
                            if (iy < 0 || iy >= (int32_t)g->h) continue;
                            for (ox = 0; ox < g->ow; ox++) {
                                ix = (int32_t)(ox * g->sw + j) - (int32_t)g->pw;
                                if (ix < 0 || ix >= (int32_t)g->w) continue;
                                acc += (int32_t)d[oy * g->ow + ox] *
                                       xc[(uint32_t)iy * g->w + (uint32_t)ix];
                            }
                        }
                    }
                    *dw++ = acc;
                }
        }
    return ed + ex;
}

/* ------------------------------------------------------------------ linear */

int32_t mexc_linear_forward(uint32_t n, uint32_t k, uint32_t o, const int8_t *x, int32_t ex,
                            const int8_t *w, int32_t ew, const int8_t *bias, int32_t eb, int8_t *y,
                            const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    mexc_conv_t g; /* a linear layer is a 1x1 convolution over (N, K, 1, 1) */
    mexc_conv_init(&g, n, k, 1u, 1u, o, 1u, 1u, 1u, 1u, 0u, 0u, 1u);
    return mexc_conv2d_forward(&g, x, ex, w, ew, bias, eb, y, ctx, tid, scratch);
}

int32_t mexc_linear_backward_input(uint32_t n, uint32_t k, uint32_t o, const int8_t *dy,
                                   int32_t ed, const int8_t *w, int32_t ew, int8_t *dx,
                                   const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    mexc_conv_t g;
    mexc_conv_init(&g, n, k, 1u, 1u, o, 1u, 1u, 1u, 1u, 0u, 0u, 1u);
    return mexc_conv2d_backward_input(&g, dy, ed, w, ew, dx, ctx, tid, scratch);
}

int32_t mexc_linear_backward_weight(uint32_t n, uint32_t k, uint32_t o, const int8_t *dy,
                                    int32_t ed, const int8_t *x, int32_t ex, int32_t *dw,
                                    const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    mexc_conv_t g;
    mexc_conv_init(&g, n, k, 1u, 1u, o, 1u, 1u, 1u, 1u, 0u, 0u, 1u);
    return mexc_conv2d_backward_weight(&g, dy, ed, x, ex, dw, ctx, tid, scratch);
}

void mexc_bias_backward(uint32_t n, uint32_t c, uint32_t s, const int8_t *dy, int32_t *db)
{
    uint32_t nn, cc, i;
    int32_t acc;
    for (cc = 0; cc < c; cc++) {
        acc = 0;
        for (nn = 0; nn < n; nn++)
            for (i = 0; i < s; i++) acc += dy[(nn * c + cc) * s + i];
        db[cc] = acc;
    }
}
