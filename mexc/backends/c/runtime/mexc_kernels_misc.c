/* ReLU, max pooling, softmax cross-entropy, residual add / gradient sum: the C form of
 * mexc/kernels/activation.py, pool.py, loss.py and elementwise.py. */
#include "mexc_kernels.h"

/* ------------------------------------------------------------------ relu (activation.py) */

void mexc_relu_forward(const int8_t *x, int8_t *y, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; i++) y[i] = x[i] > 0 ? x[i] : 0;
}

void mexc_relu_backward(const int8_t *dy, const int8_t *x, int8_t *dx, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; i++) dx[i] = x[i] > 0 ? dy[i] : 0;
}

/* ------------------------------------------------------------------ maxpool (pool.py) */

void mexc_pool_init(mexc_pool_t *p, uint32_t n, uint32_t c, uint32_t h, uint32_t w, uint32_t kh,
                    uint32_t kw, uint32_t sh, uint32_t sw, uint32_t ph, uint32_t pw)
{
    p->n = n;
    p->c = c;
    p->h = h;
    p->w = w;
    p->kh = kh;
    p->kw = kw;
    p->sh = sh;
    p->sw = sw;
    p->ph = ph;
    p->pw = pw;
    p->oh = (h + 2u * ph - kh) / sh + 1u;
    p->ow = (w + 2u * pw - kw) / sw + 1u;
}

#define MEXC_POOL_PAD (-(1 << 14)) /* pool._windows fill: padding never wins */

void mexc_maxpool2d_forward(const mexc_pool_t *p, const int8_t *x, int8_t *y, uint8_t *argmax)
{
    uint32_t plane, oy, ox, i, j, best_at;
    int32_t best, v, iy, ix;
    for (plane = 0; plane < p->n * p->c; plane++) {
        const int8_t *xp = x + plane * p->h * p->w;
        for (oy = 0; oy < p->oh; oy++)
            for (ox = 0; ox < p->ow; ox++) {
                best = 0;
                best_at = 0;
                for (i = 0; i < p->kh; i++)
                    for (j = 0; j < p->kw; j++) {
                        iy = (int32_t)(oy * p->sh + i) - (int32_t)p->ph;
                        ix = (int32_t)(ox * p->sw + j) - (int32_t)p->pw;
                        v = (iy < 0 || ix < 0 || iy >= (int32_t)p->h || ix >= (int32_t)p->w)
                                ? MEXC_POOL_PAD
                                : xp[(uint32_t)iy * p->w + (uint32_t)ix];
                        if ((i == 0 && j == 0) || v > best) { /* argmax: first maximum */
                            best = v;
                            best_at = i * p->kw + j;
                        }
                    }
                /* int16 -> int8 cast of numpy (an all-padding window wraps to 0) */
                *y++ = (int8_t)(uint8_t)((uint32_t)best & 0xFFu);
                if (argmax) *argmax++ = (uint8_t)best_at;
            }
    }
}

/* Output index of the window (oy, ox) reaching input offset t = pos + pad - i, or -1. */
static int32_t pool_out_pos(int32_t t, uint32_t stride, uint32_t limit)
{
    if (t < 0 || (uint32_t)t % stride) return -1;
    return (uint32_t)t / stride < limit ? (int32_t)((uint32_t)t / stride) : -1;
}

/* dx = scatter-add of dy at argmax (gather form). If max|dx| <= qmax the compaction shift is 0
 * and the result is the sums themselves at e_dy, exactly as the reference's early return. */
int32_t mexc_maxpool2d_backward(const mexc_pool_t *p, const int8_t *dy, int32_t ed,
                                const uint8_t *argmax, int8_t *dx, const mexc_ctx_t *ctx,
                                uint32_t tid)
{
    uint32_t plane, y, xx, i, j, idx, o;
    int32_t acc, oy, ox, e_out = ed;
    mexc_sink_t sink;
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    sink.through = 127u; /* channel exponents: up to the int8 container's qmax unrounded */
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, ed);
        idx = 0;
        for (plane = 0; plane < p->n * p->c; plane++)
            for (y = 0; y < p->h; y++)
                for (xx = 0; xx < p->w; xx++, idx++) {
                    acc = 0;
                    for (i = 0; i < p->kh; i++) {
                        oy = pool_out_pos((int32_t)(y + p->ph) - (int32_t)i, p->sh, p->oh);
                        if (oy < 0) continue;
                        for (j = 0; j < p->kw; j++) {
                            ox = pool_out_pos((int32_t)(xx + p->pw) - (int32_t)j, p->sw, p->ow);
                            if (ox < 0) continue;
                            o = (plane * p->oh + (uint32_t)oy) * p->ow + (uint32_t)ox;
                            if (argmax[o] == i * p->kw + j) acc += dy[o];
                        }
                    }
                    mexc_sink_put(&sink, idx, 0u, acc);
                }
    }
    return e_out;
}

/* ------------------------------------------------------------------ softmax_ce (loss.py) */

/* EXP_TABLE.lookup(flush) of d = m - rowmax (index shift with site-0 rounding; 0 below the
 * table, clamped to 127 above). */
static int32_t exp_lookup(int32_t d, int32_t e, const mexc_ctx_t *ctx, uint32_t key, uint32_t idx)
{
    int32_t t = mexc_shift_signed_sat(d, MEXC_EXP_IN_EXP - e, ctx->stochastic, key, idx);
    if (t < -128) return 0;
    return mexc_exp_table[(t > 127 ? 127 : t) + 128];
}

/* -10^6 ln(max(p, 1) / 2^15) within 10, for any p < 2^31 (negative above 2^15): p = (q + f) 2^j
 * with q in [128, 255] and f in [0, 1) (p's top 8 bits and the rest), mexc_nll_micro_table
 * interpolated linearly between q and q + 1 (-ln is within 8e-6 of its chord over 1/128 of
 * itself), plus (7 - j) 10^6 ln 2 */
static int64_t nll_micro(int32_t p)
{
    uint32_t q = p < 1 ? 1u : (uint32_t)p, rest = 0u;
    int32_t j = mexc_bit_length(q) - 8, lo, hi;
    if (j < 0) {
        q <<= -j;
    } else if (j > 0) {
        rest = q & ((1u << j) - 1u);
        q >>= j;
    }
    lo = mexc_nll_micro_table[q];
    hi = q < 255u ? mexc_nll_micro_table[q + 1u] : 0; /* -ln(256 / 256) */
    if (rest) lo -= (int32_t)((((uint64_t)(uint32_t)(lo - hi)) * rest + (1u << (j - 1))) >> j);
    return (int64_t)lo + (int64_t)(7 - j) * 693147;
}

/* loss.label_gap: the label's gap d <= 0 at exponent e, moved to exponent -16 (exact from
 * e = -16 up, saturated at 2^31 - 1; rounded half away from zero below), as its magnitude */
static uint32_t label_gap(int32_t d, int32_t e)
{
    uint32_t mag = (uint32_t)(-d); /* <= 255 */
    int32_t s = e + 16, t;
    if (s >= 0) {
        uint64_t g = (uint64_t)mag << (s < 31 ? s : 31);
        return g > 0x7FFFFFFFu ? 0x7FFFFFFFu : (uint32_t)g;
    }
    t = -s < 62 ? -s : 62;
    return t >= 32 ? 0u : (uint32_t)(((uint64_t)mag + (1ull << (t - 1))) >> t);
}

int32_t mexc_softmax_ce_forward(uint32_t n, uint32_t k, const int8_t *logits, int32_t e,
                                const int32_t *labels, uint32_t valid, int16_t *probs,
                                const mexc_ctx_t *ctx, uint32_t tid)
{
    const uint32_t key = mexc_site_key(ctx, tid, 0);
    uint32_t r, j, y, rows = valid < n ? valid : n;
    int32_t mx, srow, p;
    int64_t ln_s;
    /* micro-nats: a row's ln(S / 2^15) (at most 11.1e6) plus its gap (at most 3.3e10) */
    uint64_t loss = 0u;
    for (r = 0; r < n; r++) {
        const int8_t *m = logits + r * k;
        mx = m[0];
        for (j = 1; j < k; j++) mx = m[j] > mx ? m[j] : mx;
        srow = 0;
        for (j = 0; j < k; j++) srow += exp_lookup(m[j] - mx, e, ctx, key, r * k + j);
        for (j = 0; j < k; j++) {
            /* E << 15 <= 2^30 */
            p = mexc_idiv_round(exp_lookup(m[j] - mx, e, ctx, key, r * k + j) << 15, (uint32_t)srow);
            probs[r * k + j] = (int16_t)(p < 32767 ? p : 32767);
        }
        if (r < rows) { /* ln(S / 2^15) - gap 2^-16 (loss.ce_loss), both terms >= 0 */
            y = labels[r] < 0 ? 0u : ((uint32_t)labels[r] < k ? (uint32_t)labels[r] : k - 1u);
            ln_s = -nll_micro(srow); /* >= 0 up to the table's rounding */
            loss += (uint64_t)(ln_s > 0 ? ln_s : 0);
            loss += ((uint64_t)label_gap(m[y] - mx, e) * 1000000u + (1u << 15)) >> 16;
        }
    }
    /* the mean in milli-nats, rounded (unsigned: no signed 64-bit division on an MCU) */
    loss = rows ? (loss + 500u * (uint64_t)rows) / (1000u * (uint64_t)rows) : 0u;
    return loss > 0x7FFFFFFFu ? 0x7FFFFFFF : (int32_t)loss;
}

int32_t mexc_softmax_ce_backward(uint32_t n, uint32_t k, const int16_t *probs,
                                 const int32_t *labels, uint32_t valid, int8_t *dx,
                                 const mexc_ctx_t *ctx, uint32_t tid)
{
    uint32_t r, j, rows = valid < n ? valid : n, div = rows ? rows : 1u;
    int32_t t, s, e_out = 0;
    /* loss.grad_shift: ceil_log2(div) bits, while |t| << sh stays below 2^31
     * (|t| <= 2^15 + k / 2) */
    int32_t sh = mexc_ceil_log2(div), room = 31 - mexc_bit_length(32768u + k / 2u);
    mexc_sink_t sink;
    if (room < 0) room = 0;
    if (sh > room) sh = room;
    mexc_sink_init(&sink, dx, ctx, mexc_site_key(ctx, tid, 0), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, MEXC_SOFTMAX_GRAD_EXP - sh);
        for (r = 0; r < n; r++) {
            /* t = p - S onehot, S the row's sum: each row of t sums to 0 (loss.py) */
            for (s = 0, j = 0; j < k; j++) s += probs[r * k + j];
            for (j = 0; j < k; j++) {
                t = 0;
                if (r < rows) t = (int32_t)probs[r * k + j] - ((uint32_t)labels[r] == j ? s : 0);
                mexc_sink_put(&sink, r * k + j, 0u, mexc_idiv_round(t * (1 << sh), div));
            }
        }
    }
    return e_out;
}

/* ------------------------------------------------------------------ add / grad_sum */

int32_t mexc_grad_sum(uint32_t t, const int8_t *const *x, const int32_t *e, uint32_t n,
                      int8_t *out, const mexc_ctx_t *ctx, uint32_t tid)
{
    int32_t b[13], target, acc, e_out = 0;
    uint32_t keys[13], i, k;
    mexc_sink_t sink;
    if (t == 1u) {
        for (k = 0; k < n; k++) out[k] = x[0][k];
        return e[0];
    }
    for (i = 0; i < t; i++) {
        b[i] = 7;
        keys[i] = mexc_site_key(ctx, tid, i);
    }
    target = mexc_aligned_target(t, e, b);
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, t), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, target);
        for (k = 0; k < n; k++) {
            acc = 0;
            for (i = 0; i < t; i++)
                acc += mexc_shift_signed(x[i][k], target - e[i], ctx->stochastic, keys[i], k);
            mexc_sink_put(&sink, k, 0u, acc);
        }
    }
    return e_out;
}

/* param_grad_sum (docs/numerics.md section 7c): t <= 13 int32 accumulators of n elements at
   exponents e, added as an aligned sum into out (term i at site i): term i bounded by the bit
   length of its largest magnitude, all-zero terms left out of the target and the sum (the
   lowest exponent when every term is zero); returns the sum's exponent. */
int32_t mexc_param_grad_sum(uint32_t t, const int32_t *const *x, const int32_t *e, uint32_t n,
                            int32_t *out, const mexc_ctx_t *ctx, uint32_t tid)
{
    int32_t b[13], target = e[0], low = 0, top = 0, live = 0, acc;
    uint32_t keys[13], i, k;
    for (i = 0; i < t; i++) {
        b[i] = mexc_bit_length(mexc_max_abs(x[i], n));
        keys[i] = mexc_site_key(ctx, tid, i);
        if (e[i] < target) target = e[i];
        if (b[i] == 0) continue;
        if (!live || e[i] < low) low = e[i];
        if (!live || e[i] + b[i] > top) top = e[i] + b[i];
        live = 1;
    }
    if (live) {
        target = top + mexc_bit_length(t) - 31;
        if (low > target) target = low;
    }
    for (k = 0; k < n; k++) {
        acc = 0;
        for (i = 0; i < t; i++)
            if (b[i] > 0)
                acc += mexc_shift_signed(x[i][k], target - e[i], ctx->stochastic, keys[i], k);
        out[k] = acc;
    }
    return target;
}

/* concat of t tensors along one axis, input i seen as (outer, k[i] * inner): each mantissa
   shifted to max(min e, max e - 24) (right shifts rounded: site 0, index = the output's flat
   index), then one compaction (site 1). */
int32_t mexc_concat(uint32_t t, const int8_t *const *x, const int32_t *e, const uint32_t *k,
                    uint32_t outer, uint32_t inner, int8_t *out, const mexc_ctx_t *ctx,
                    uint32_t tid)
{
    int32_t lo = e[0], hi = e[0], target, e_out = 0;
    uint32_t key = mexc_site_key(ctx, tid, 0u), i, o, j, idx, len;
    const int8_t *src;
    mexc_sink_t sink;
    for (i = 1; i < t; i++) {
        if (e[i] < lo) lo = e[i];
        if (e[i] > hi) hi = e[i];
    }
    target = hi - 24 > lo ? hi - 24 : lo;
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, 1u), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, target);
        idx = 0;
        for (o = 0; o < outer; o++) {
            for (i = 0; i < t; i++) {
                len = k[i] * inner;
                src = x[i] + (size_t)o * len;
                for (j = 0; j < len; j++, idx++)
                    mexc_sink_put(&sink, idx, 0u,
                                  mexc_shift_signed(src[j], target - e[i], ctx->stochastic, key,
                                                    idx));
            }
        }
    }
    return e_out;
}

/* ------------------------------------------------------------------ mul (elementwise.py) */

/* x * g: x seen as (o, m, inner), g as (m,) along the middle axis (equal shapes: o = inner =
   1): acc = m_x m_g at e_x + e_g, compaction site 0. */
int32_t mexc_mul_forward(const int8_t *x, int32_t ex, const int8_t *g, int32_t eg, uint32_t o,
                         uint32_t m, uint32_t inner, int8_t *out, const mexc_ctx_t *ctx,
                         uint32_t tid)
{
    int32_t e_out = 0;
    uint32_t a, b, c, idx;
    mexc_sink_t sink;
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, 0u), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, ex + eg);
        idx = 0;
        for (a = 0; a < o; a++)
            for (b = 0; b < m; b++)
                for (c = 0; c < inner; c++, idx++)
                    mexc_sink_put(&sink, idx, 0u, (int32_t)x[idx] * (int32_t)g[b]);
    }
    return e_out;
}

/* a / b of n elements each: acc = idiv_round(sign(m_a m_b) |m_a| 2^15, |m_b|), m_a 2^16
   where m_b = 0 (b taken as half its unit), at e_a - e_b - 15, compacted into out (site 0);
   returns its exponent. */
int32_t mexc_div_forward(const int8_t *a, int32_t ea, const int8_t *b, int32_t eb, uint32_t n,
                         int8_t *out, const mexc_ctx_t *ctx, uint32_t tid)
{
    int32_t e_out = 0, ma, mb, q;
    uint32_t i;
    mexc_sink_t sink;
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, 0u), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, ea - eb - MEXC_DIV_BITS);
        for (i = 0; i < n; i++) {
            ma = a[i];
            mb = b[i];
            q = ma * (1 << (MEXC_DIV_BITS + 1));
            if (mb != 0) {
                q = (ma < 0 ? -ma : ma) * (1 << MEXC_DIV_BITS);
                q = mexc_idiv_round((ma < 0) != (mb < 0) ? -q : q, (uint32_t)(mb < 0 ? -mb : mb));
            }
            mexc_sink_put(&sink, i, 0u, q);
        }
    }
    return e_out;
}

/* dg of x * g: acc[b] = sum over (a, c) of dy_m x_m, each shifted right by t (site 1 at x's
   flat index; t = 0: exact), at e_dy + e_x + t. out NULL: acc is the result (a parameter's
   int32 gradient) and its exponent is returned; else acc (caller scratch) is compacted into out
   (site 0) and the result's exponent is returned. */
int32_t mexc_mul_backward_factor(const int8_t *dy, int32_t ed, const int8_t *x, int32_t ex,
                                 uint32_t o, uint32_t m, uint32_t inner, uint32_t t,
                                 int32_t *acc, int8_t *out, const mexc_ctx_t *ctx, uint32_t tid)
{
    uint32_t a, b, c, idx = 0, key = mexc_site_key(ctx, tid, 1u);
    int32_t p, e = ed + ex + (int32_t)t, e_out = 0;
    mexc_sink_t sink;
    for (b = 0; b < m; b++) acc[b] = 0;
    for (a = 0; a < o; a++)
        for (b = 0; b < m; b++)
            for (c = 0; c < inner; c++, idx++) {
                p = (int32_t)dy[idx] * (int32_t)x[idx];
                acc[b] += t ? mexc_shift_signed(p, (int32_t)t, ctx->stochastic, key, idx) : p;
            }
    if (!out) return e;
    mexc_sink_init(&sink, out, ctx, mexc_site_key(ctx, tid, 0u), NULL, NULL, 0u, 0);
    for (sink.pass = 0; sink.pass < 2; sink.pass++) {
        if (sink.pass == 1) e_out = mexc_sink_finish(&sink, e);
        for (b = 0; b < m; b++) mexc_sink_put(&sink, b, 0u, acc[b]);
    }
    return e_out;
}

int32_t mexc_add_forward(const int8_t *a, int32_t ea, const int8_t *b, int32_t eb, uint32_t n,
                         int8_t *out, const mexc_ctx_t *ctx, uint32_t tid)
{
    const int8_t *x[2];
    int32_t e[2];
    x[0] = a;
    x[1] = b;
    e[0] = ea;
    e[1] = eb;
    return mexc_grad_sum(2u, x, e, n, out, ctx, tid);
}
