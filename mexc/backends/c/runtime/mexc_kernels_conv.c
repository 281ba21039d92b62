/* The bookkeeping of the convolution and linear products (mexc/kernels/conv.py, linear.py),
 * whose loops kernels.c has from TVM TIR, and the bias gradient. */
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

/* ------------------------------------------------------------------ the products' bookkeeping */

const int8_t *mexc_product_begin(mexc_product_t *p, const int8_t *a, uint32_t n, int32_t e_a,
                                 int32_t e_b, uint32_t k, int32_t has_bias, int32_t e_bias,
                                 const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch)
{
    int32_t e[2], b[2], t;
    a = mexc_fit_product(a, n, &e_a, k, ctx, mexc_site_key(ctx, tid, 3), scratch);
    p->e_acc = e_a + e_b;
    p->e_val = p->e_acc;
    p->ta = 0;
    p->tb = 0;
    p->stoch = ctx->stochastic;
    p->bits = ctx->bits;
    p->k0 = mexc_site_key(ctx, tid, 0);
    p->k1 = 0u;
    p->k2 = 0u;
    p->amax = 0;
    p->s = 0;
    if (has_bias) { /* linear.add_bias: aligned_sum([(acc, e, product_bits(K)), (b, eb, 7)]) */
        e[0] = p->e_acc;
        e[1] = e_bias;
        b[0] = mexc_product_bits(k);
        b[1] = 7;
        t = mexc_aligned_target(2u, e, b);
        p->ta = t - p->e_acc;
        p->tb = t - e_bias;
        p->e_val = t;
        p->k1 = mexc_site_key(ctx, tid, 1);
        p->k2 = mexc_site_key(ctx, tid, 2);
    }
    return a;
}

int32_t mexc_product_end(mexc_product_t *p)
{
    p->s = mexc_compaction_shift((uint32_t)p->amax, p->bits);
    return p->e_val + p->s;
}

int32_t mexc_product_end_channels(mexc_product_t *p, const mexc_chan_t *ch)
{
    int32_t frame;
    if (mexc_channel_shifts(ch, NULL, p->e_val, p->bits, 0, &frame)) return frame;
    return p->e_val; /* every value is 0 (so is every word): the plain rule's exponent */
}

/* ------------------------------------------------------------------ bias_backward */

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
