/* mexc runtime primitives: the C form of mexc/numerics.py (docs/numerics.md). */
#include "mexc_rt.h"

/* ------------------------------------------------------------------ PRNG */

uint32_t mexc_mix32(uint32_t v) /* numerics.mix32 (lowbias32) */
{
    v ^= v >> 16;
    v *= 0x7FEB352Du;
    v ^= v >> 15;
    v *= 0x846CA68Bu;
    v ^= v >> 16;
    return v;
}

uint32_t mexc_stream_key(uint32_t seed, uint32_t step, uint32_t tid) /* numerics.stream_key */
{
    uint32_t k = mexc_mix32(seed);
    k = mexc_mix32(k ^ step);
    return mexc_mix32(k ^ tid);
}

uint32_t mexc_rand(uint32_t key, uint32_t idx) /* numerics.random_bits */
{
    return mexc_mix32(key ^ (idx * MEXC_GOLDEN32));
}

uint32_t mexc_site_key(const mexc_ctx_t *ctx, uint32_t tid, uint32_t j) /* RoundCtx.key */
{
    return mexc_stream_key(ctx->seed, ctx->step, tid + j);
}

/* ------------------------------------------------------------------ helpers */

int32_t mexc_qmax(int32_t bits) { return (int32_t)((1u << (bits - 1)) - 1u); }

int32_t mexc_bit_length(uint32_t v)
{
    int32_t n = 0;
    while (v) {
        v >>= 1;
        n++;
    }
    return n;
}

int32_t mexc_ceil_log2(uint32_t n) { return n <= 1u ? 0 : mexc_bit_length(n - 1u); }

uint32_t mexc_uabs(int32_t x) { return x < 0 ? 0u - (uint32_t)x : (uint32_t)x; }

int8_t mexc_saturate(int32_t x, int32_t bits) /* numerics.saturate */
{
    int32_t q = mexc_qmax(bits);
    return (int8_t)(x > q ? q : (x < -q ? -q : x));
}

void mexc_fill32(int32_t *p, int32_t v, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; i++) p[i] = v;
}

/* ------------------------------------------------------------------ shifts */

/* numerics.shift_right: (x >> s) + (((x & mask) + r) >> s), inner sum as uint32; s >= 32 -> 0 */
int32_t mexc_shift_right(int32_t x, int32_t s, int32_t stoch, uint32_t key, uint32_t idx)
{
    uint32_t mask, r, low;
    if (s <= 0) return x;
    if (s >= 32) return 0;
    mask = (1u << s) - 1u;
    r = stoch ? (mexc_rand(key, idx) & mask) : (1u << (s - 1));
    low = ((uint32_t)x & mask) + r;
    return (x >> s) + (int32_t)(low >> s);
}

int32_t mexc_shift_left(int32_t x, int32_t s) /* numerics.shift_left (exact) */
{
    return (int32_t)((uint32_t)x << s);
}

int32_t mexc_shift_signed(int32_t x, int32_t s, int32_t stoch, uint32_t key, uint32_t idx)
{
    return s < 0 ? mexc_shift_left(x, -s) : mexc_shift_right(x, s, stoch, key, idx);
}

/* numerics.shift_left_saturating: clip(int64(x << min(s, 54)), +-2^limit) incl. int64 wrap */
int32_t mexc_shift_left_sat(int32_t x, int32_t s, int32_t limit_bits)
{
    int64_t v, lim = (int64_t)1 << limit_bits;
    if (s > 54) s = 54;
    v = (int64_t)((uint64_t)(int64_t)x << s);
    if (v > lim) return (int32_t)lim;
    if (v < -lim) return (int32_t)-lim;
    return (int32_t)v;
}

int32_t mexc_shift_signed_sat(int32_t x, int32_t s, int32_t stoch, uint32_t key, uint32_t idx)
{
    return s >= 0 ? mexc_shift_right(x, s, stoch, key, idx) : mexc_shift_left_sat(x, -s, 30);
}

/* ------------------------------------------------------------------ compaction */

int32_t mexc_compaction_shift(uint32_t max_abs, int32_t bits) /* numerics.compaction_shift */
{
    uint64_t q = (uint64_t)mexc_qmax(bits);
    int32_t s = 0;
    while ((uint64_t)max_abs > (q << s)) s++;
    return s;
}

uint32_t mexc_max_abs(const int32_t *x, uint32_t n)
{
    uint32_t i, m = 0, a;
    for (i = 0; i < n; i++) {
        a = mexc_uabs(x[i]);
        if (a > m) m = a;
    }
    return m;
}

int32_t mexc_compact(const int32_t *acc, int8_t *out, uint32_t n, int32_t e, int32_t bits,
                     int32_t stoch, uint32_t key)
{
    int32_t s = mexc_compaction_shift(mexc_max_abs(acc, n), bits);
    uint32_t i;
    for (i = 0; i < n; i++) out[i] = mexc_saturate(mexc_shift_right(acc[i], s, stoch, key, i), bits);
    return e + s;
}

void mexc_compact_grouped(const int32_t *acc, int8_t *out, uint32_t groups, uint32_t per,
                          const int32_t *e_in, int32_t *e_out, int32_t bits, int32_t stoch,
                          uint32_t key)
{
    uint32_t g, i, base;
    int32_t s;
    for (g = 0; g < groups; g++) {
        base = g * per;
        s = mexc_compaction_shift(mexc_max_abs(acc + base, per), bits);
        for (i = base; i < base + per; i++)
            out[i] = mexc_saturate(mexc_shift_right(acc[i], s, stoch, key, i), bits);
        e_out[g] = e_in[g] + s;
    }
}

int32_t mexc_compact_to_bits(const int32_t *x, int32_t *out, uint32_t n, int32_t mag_bits,
                             int32_t stoch, uint32_t key)
{
    uint64_t m = mexc_max_abs(x, n);
    int32_t s = 0;
    uint32_t i;
    while (m > ((uint64_t)1 << mag_bits) << s) s++;
    for (i = 0; i < n; i++) out[i] = mexc_shift_right(x[i], s, stoch, key, i);
    return s;
}

/* ------------------------------------------------------------------ channel exponents */

int32_t mexc_channel_shifts(const mexc_chan_t *ch, const int32_t *e_c, int32_t e, int32_t bits,
                            int32_t signed_, int32_t *frame)
{
    uint32_t c;
    int32_t x, t, top = 0, any = 0, ec;
    for (c = 0; c < ch->c; c++) {
        if (ch->word[c] == 0u) continue;
        ec = e_c ? e_c[c] : e;
        x = ec + (signed_ ? mexc_rescale_shift(ch->word[c], bits)
                          : mexc_compaction_shift(ch->word[c], bits));
        if (!any || x > top) top = x;
        any = 1;
    }
    if (!any) return 0;
    *frame = top - (8 - bits); /* F: the int8 container keeps 8 - B bits above B */
    for (c = 0; c < ch->c; c++) {
        if (ch->word[c] == 0u) continue; /* an all-zero channel is 0 at any shift: word 0 */
        ec = e_c ? e_c[c] : e;
        x = ec + (signed_ ? mexc_rescale_shift(ch->word[c], bits)
                          : mexc_compaction_shift(ch->word[c], bits));
        t = x > *frame ? x : *frame;
        ch->word[c] = ((uint32_t)(t - ec) & 0xFFFFu) | ((uint32_t)(t - *frame) << 16);
    }
    return 1;
}

int8_t mexc_frame_round(int32_t v, uint32_t word, int32_t bits, int32_t stoch, uint32_t key,
                        uint32_t idx)
{
    const int32_t right = (int32_t)(int16_t)(uint16_t)(word & 0xFFFFu);
    const int32_t m = mexc_saturate(mexc_shift_signed(v, right, stoch, key, idx), bits);
    return (int8_t)mexc_shift_left(m, (int32_t)(word >> 16)); /* |m| << up <= 127 (section 5) */
}

int8_t mexc_channel_round(const mexc_chan_t *ch, uint32_t c, int32_t v, int32_t bits,
                          int32_t stoch, uint32_t key, uint32_t idx)
{
    return mexc_frame_round(v, ch->word[c], bits, stoch, key, idx);
}

int8_t mexc_chan_note(void *amax_c, int32_t v)
{
    uint32_t *a = (uint32_t *)amax_c, m = mexc_uabs(v);
    if (m > *a) *a = m;
    return 0;
}

void mexc_chan_zero(const mexc_chan_t *ch)
{
    uint32_t c;
    for (c = 0; c < ch->c; c++) ch->word[c] = 0u;
}

/* ------------------------------------------------------------------ aligned sum */

int32_t mexc_aligned_target(uint32_t m, const int32_t *e, const int32_t *b)
{
    int32_t e_min = e[0], e_top = e[0] + b[0], c, t;
    uint32_t i;
    for (i = 1; i < m; i++) {
        if (e[i] < e_min) e_min = e[i];
        if (e[i] + b[i] > e_top) e_top = e[i] + b[i];
    }
    c = m > 1u ? mexc_bit_length(m) : 0;
    t = e_top + c - 31;
    return t > e_min ? t : e_min;
}

int32_t mexc_aligned_sum(uint32_t m, const int32_t *const *x, const int32_t *e, const int32_t *b,
                         int32_t *out, uint32_t n, int32_t stoch, const uint32_t *keys)
{
    int32_t target = mexc_aligned_target(m, e, b), acc;
    uint32_t i, k;
    for (k = 0; k < n; k++) {
        acc = 0;
        for (i = 0; i < m; i++)
            acc += mexc_shift_signed(x[i][k], target - e[i], stoch, keys ? keys[i] : 0u, k);
        out[k] = acc;
    }
    return target;
}

/* ------------------------------------------------------------------ divide by constant */

mexc_recip_t mexc_recip_of(uint32_t divisor) /* numerics.Reciprocal.of, divisor >= 1 */
{
    mexc_recip_t r;
    uint64_t num;
    r.divisor = divisor;
    r.pow2 = 0;
    while (!((divisor >> r.pow2) & 1u)) r.pow2++;
    r.odd = divisor >> r.pow2;
    r.shift = 16u + (uint32_t)mexc_ceil_log2(r.odd);
    num = (uint64_t)1 << r.shift;
    r.mult = (uint32_t)((num + r.odd - 1u) / r.odd);
    return r;
}

int32_t mexc_div_const(int32_t x, const mexc_recip_t *r) /* numerics.div_const, |x| <= 2^15 */
{
    uint64_t n = (uint64_t)mexc_uabs(x) + (r->odd - 1u) / 2u;
    int32_t q = (int32_t)((n * r->mult) >> r->shift);
    return x < 0 ? -q : q;
}

/* ------------------------------------------------------------------ sqrt and division */

uint32_t mexc_isqrt32(uint32_t n) /* digit by digit, 2 bits per step */
{
    uint32_t res = 0, bit = 1u << 30;
    while (bit > n) bit >>= 2;
    while (bit) {
        if (n >= res + bit) {
            n -= res + bit;
            res = (res >> 1) + bit;
        } else {
            res >>= 1;
        }
        bit >>= 2;
    }
    return res;
}

uint32_t mexc_isqrt64(uint64_t n)
{
    uint64_t res = 0, bit = (uint64_t)1 << 62;
    if (n <= 0xFFFFFFFFull) return mexc_isqrt32((uint32_t)n);
    while (bit > n) bit >>= 2;
    while (bit) {
        if (n >= res + bit) {
            n -= res + bit;
            res = (res >> 1) + bit;
        } else {
            res >>= 1;
        }
        bit >>= 2;
    }
    return (uint32_t)res;
}

int32_t mexc_idiv_round(int32_t a, uint32_t b) /* sign(a) * floor((|a| + b/2) / b) */
{
    uint32_t q = (mexc_uabs(a) + b / 2u) / b;
    return a < 0 ? -(int32_t)q : (int32_t)q;
}

int32_t mexc_idiv_floor(int32_t a, uint32_t b) /* floor(a / b) */
{
    uint32_t q;
    if (a >= 0) return (int32_t)((uint32_t)a / b);
    q = (mexc_uabs(a) - 1u) / b; /* floor(a/b) = -((|a| - 1) / b) - 1 */
    return -(int32_t)q - 1;
}

/* ------------------------------------------------------------------ checksum */

uint64_t mexc_fnv1a64(const void *data, uint32_t nbytes, uint64_t h)
{
    const uint8_t *p = (const uint8_t *)data;
    uint32_t i;
    for (i = 0; i < nbytes; i++) h = (h ^ p[i]) * 0x100000001B3ull;
    return h;
}

uint64_t mexc_fnv1a64_i32(const int32_t *e, uint32_t n, uint64_t h)
{
    uint32_t i, v, j;
    for (i = 0; i < n; i++) {
        v = (uint32_t)e[i];
        for (j = 0; j < 4u; j++) h = (h ^ ((v >> (8u * j)) & 0xFFu)) * 0x100000001B3ull;
    }
    return h;
}

void mexc_hex64(uint64_t h, char out[17])
{
    static const char digits[] = "0123456789abcdef";
    int i;
    for (i = 15; i >= 0; i--) {
        out[i] = digits[h & 0xFu];
        h >>= 4;
    }
    out[16] = 0;
}

/* ------------------------------------------------------------------ two-pass sink */

void mexc_sink_init(mexc_sink_t *k, int8_t *out, const mexc_ctx_t *ctx, uint32_t key,
                    uint32_t *camax, int32_t *cshift, uint32_t channels, int32_t slot)
{
    uint32_t c;
    const mexc_chan_t *ch = slot >= 0 && ctx->chan ? &ctx->chan[slot] : NULL;
    k->chan = ch && ch->c ? ch : NULL;
    k->through = 0u;
    k->next = 0xFFFFFFFFu; /* the first put divides */
    k->ch = 0u;
    k->left = 0u;
    if (k->chan)
        for (c = 0; c < k->chan->c; c++) k->chan->word[c] = 0u;
    k->pass = 0;
    k->stoch = ctx->stochastic;
    k->bits = ctx->bits;
    k->key = key;
    k->amax = 0;
    k->shift = 0;
    k->camax = camax;
    k->cshift = cshift;
    k->out = out;
    if (camax)
        for (c = 0; c < channels; c++) camax[c] = 0;
}

/* The channel of element idx: (idx / inner) % c, divided only where the puts jump. */
static uint32_t sink_channel(mexc_sink_t *k, uint32_t idx)
{
    const mexc_chan_t *g = k->chan;
    uint32_t c;
    if (idx != k->next) {
        k->ch = (idx / g->inner) % g->c;
        k->left = g->inner - idx % g->inner;
    }
    c = k->ch;
    k->next = idx + 1u;
    if (--k->left == 0u) {
        k->ch = k->ch + 1u == g->c ? 0u : k->ch + 1u;
        k->left = g->inner;
    }
    return c;
}

void mexc_sink_put(mexc_sink_t *k, uint32_t idx, uint32_t ch, int32_t v)
{
    uint32_t a;
    int32_t s;
    if (k->chan) {
        ch = sink_channel(k, idx);
        if (k->pass == 0) {
            a = mexc_uabs(v);
            if (a > k->chan->word[ch]) k->chan->word[ch] = a;
        } else {
            k->out[idx] = mexc_channel_round(k->chan, ch, v, k->bits, k->stoch, k->key, idx);
        }
        return;
    }
    if (k->pass == 0) {
        a = mexc_uabs(v);
        if (k->camax) {
            if (a > k->camax[ch]) k->camax[ch] = a;
        } else if (a > k->amax) {
            k->amax = a;
        }
        return;
    }
    s = k->cshift ? k->cshift[ch] : k->shift;
    k->out[idx] = mexc_saturate(mexc_shift_right(v, s, k->stoch, k->key, idx), k->bits);
}

/* channel exponents: 1 when the channel rule applies; else (every channel zero, or a result
 * within k->through) the sink continues as one exponent per tensor with shift 0. */
static int32_t sink_channels(mexc_sink_t *k, const int32_t *e_c, int32_t e, int32_t *frame)
{
    uint32_t c, top = 0u;
    for (c = 0; c < k->chan->c; c++)
        if (k->chan->word[c] > top) top = k->chan->word[c];
    if (top > k->through && mexc_channel_shifts(k->chan, e_c, e, k->bits, 0, frame)) {
        k->pass = 1;
        return 1;
    }
    if (top && top <= k->through) k->bits = 8; /* passes unrounded: |v| <= through <= 127 */
    k->chan = NULL;
    k->camax = NULL;
    k->cshift = NULL;
    k->shift = 0;
    return 0;
}

int32_t mexc_sink_finish(mexc_sink_t *k, int32_t e)
{
    int32_t frame;
    if (k->chan && sink_channels(k, NULL, e, &frame)) return frame;
    k->shift = mexc_compaction_shift(k->amax, k->bits);
    k->pass = 1;
    return e + k->shift;
}

/* compact_common: E = max over non-zero channels of e_c + s_c (max e_c if all zero);
 * every channel shifts by E - e_c. cshift may alias camax's storage only if distinct arrays. */
int32_t mexc_sink_finish_common(mexc_sink_t *k, const int32_t *e_c, uint32_t channels)
{
    int32_t best = 0, emax = e_c[0], cand;
    int32_t any = 0;
    uint32_t c;
    if (k->chan) {
        if (sink_channels(k, e_c, 0, &best)) return best;
        for (c = 1; c < channels; c++) /* all zero: compact_common's exponent, values 0 */
            if (e_c[c] > emax) emax = e_c[c];
        k->pass = 1;
        return emax;
    }
    for (c = 0; c < channels; c++) {
        if (e_c[c] > emax) emax = e_c[c];
        if (k->camax[c] == 0u) continue;
        cand = e_c[c] + mexc_compaction_shift(k->camax[c], k->bits);
        if (!any || cand > best) best = cand;
        any = 1;
    }
    if (!any) best = emax;
    for (c = 0; c < channels; c++) k->cshift[c] = best - e_c[c];
    k->pass = 1;
    return best;
}
