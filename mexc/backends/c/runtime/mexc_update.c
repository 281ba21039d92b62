/* Integer SGD with momentum: the C form of numerics.sgd_momentum_update / reactive_rescale. */
#include "mexc_rt.h"

void mexc_update_keys(uint32_t seed, uint32_t step, uint32_t tid_base, uint32_t keys[9])
{
    uint32_t j;
    for (j = 0; j < MEXC_UPDATE_SITES; j++) keys[j] = mexc_stream_key(seed, step, tid_base + j);
}

/* One group of numerics.compact(grouped=True) on its int32 row, kept in place (int32 holding
 * B-bit values), rounding keyed by the flat index base + i; *e += s. */
static void compact_row_inplace(int32_t *row, uint32_t per, uint32_t base, int32_t *e,
                                int32_t bits, int32_t stoch, uint32_t key)
{
    const int32_t s = mexc_compaction_shift(mexc_max_abs(row, per), bits);
    uint32_t i;
    for (i = 0; i < per; i++)
        row[i] = mexc_saturate(mexc_shift_right(row[i], s, stoch, key, base + i), bits);
    *e += s;
}

/* One group of numerics.compact(grouped=True): tmp[0..per) -> out[0..per), rounding keyed by
 * the flat index base + i; returns e + s. */
static int32_t compact_group(const int32_t *tmp, int8_t *out, uint32_t per, uint32_t base,
                             int32_t e, int32_t bits, int32_t st, uint32_t key)
{
    int32_t s = mexc_compaction_shift(mexc_max_abs(tmp, per), bits);
    uint32_t i;
    for (i = 0; i < per; i++)
        out[i] = mexc_saturate(mexc_shift_right(tmp[i], s, st, key, base + i), bits);
    return e + s;
}

/* numerics.weight_bound_bits: |w| < 2^b, b = B - 1, or 7 when w's rows have channel exponents */
static int32_t weight_bound_bits(int32_t bits, const mexc_chan_t *rows)
{
    return rows && bits < 8 ? 7 : bits - 1;
}

/* Channel exponents of the weight's rows (numerics.reactive_rescale with channels): note |x| of
 * element i in its row's maximum (pass 0). */
static void note_row(const mexc_chan_t *rows, uint32_t i, int32_t x)
{
    const uint32_t a = mexc_uabs(x), r = i / rows->inner;
    if (a > rows->word[r]) rows->word[r] = a;
}

static void clear_rows(const mexc_chan_t *rows)
{
    uint32_t r;
    if (rows)
        for (r = 0; r < rows->c; r++) rows->word[r] = 0u;
}

/* Two-term per-group aligned_sum: acc[i] = align(x1[i]) + align(x2[i]); e_x1 per group,
 * x1 = m1[i] * f1 (int8 source) or buf[i] (f1 = 0); x2 = buf[i] or m2[i] * f2. */
static int32_t target2(int32_t e1, int32_t b1, int32_t e2, int32_t b2)
{
    int32_t e[2], b[2];
    e[0] = e1;
    e[1] = e2;
    b[0] = b1;
    b[1] = b2;
    return mexc_aligned_target(2u, e, b);
}

/* numerics section 12 step 2 (SGD) and 12b step 1b (Adam) for one group: g = compact(g + wd * w)
 * in place over its row (int32 holding B-bit values, exponent *e_g); w_row: the group's weights;
 * keys: the two terms' sites and the compaction's. */
static void l2_row(int32_t *row, const int8_t *w_row, uint32_t per, uint32_t base, int32_t *e_g,
                   int32_t we, mexc_fixed_t wd, int32_t bits, int32_t wb, int32_t st,
                   const uint32_t keys[3])
{
    const int32_t b = bits - 1, wd_exp = we - wd.shift;
    const int32_t wd_bits = wb + mexc_bit_length((uint32_t)wd.num);
    const int32_t t = target2(*e_g, b, wd_exp, wd_bits);
    uint32_t i;
    for (i = 0; i < per; i++)
        row[i] = mexc_shift_signed(row[i], t - *e_g, st, keys[0], base + i) +
                 mexc_shift_signed((int32_t)w_row[i] * wd.num, t - wd_exp, st, keys[1], base + i);
    *e_g = t;
    compact_row_inplace(row, per, base, e_g, bits, st, keys[2]);
}

/* The reactive rescale's shift for max |w_acc| = m: > 0 rounds right, < 0 shifts left exactly,
 * 0 keeps the values (numerics section 12, step 6). */
int32_t mexc_rescale_shift(uint32_t m, int32_t bits)
{
    const uint32_t q = (uint32_t)mexc_qmax(bits);
    int32_t s = 0;
    if (m > q) return mexc_compaction_shift(m, bits);
    if (m == 0u) return 0;
    while ((m << (s + 1)) <= q) s++;
    return -s;
}

/* One element of the reactive rescale by shift s (mexc_rescale_shift). */
int8_t mexc_rescale_one(int32_t x, int32_t s, int32_t bits, int32_t stoch, uint32_t key,
                        uint32_t i)
{
    if (s > 0) return mexc_saturate(mexc_shift_right(x, s, stoch, key, i), bits);
    return mexc_saturate(mexc_shift_left(x, -s), bits);
}

int32_t mexc_reactive_rescale(const int32_t *w_acc, int8_t *w, uint32_t n, int32_t w_exp,
                              int32_t bits, int32_t stoch, uint32_t key)
{
    const int32_t s = mexc_rescale_shift(mexc_max_abs(w_acc, n), bits);
    uint32_t i;
    for (i = 0; i < n; i++) w[i] = mexc_rescale_one(w_acc[i], s, bits, stoch, key, i);
    return w_exp + s;
}

/* numerics.zero_weight_exponent: w_exp, or for an all-zero w the largest e_v - lr.shift of the
 * groups whose update lr * v is nonzero (none nonzero: w_exp). */
static int32_t zero_weight_exponent(const int8_t *w, const int8_t *v, uint32_t groups,
                                    uint32_t per, const int32_t *v_exp, mexc_fixed_t lr,
                                    int32_t we)
{
    uint32_t g, i, n = groups * per;
    int32_t found = 0, best = 0, e;
    for (i = 0; i < n; i++)
        if (w[i] != 0) return we;
    if (lr.num == 0) return we;
    for (g = 0; g < groups; g++)
        for (i = g * per; i < (g + 1u) * per; i++)
            if (v[i] != 0) {
                e = v_exp[g] - lr.shift;
                if (!found || e > best) best = e;
                found = 1;
                break;
            }
    return found ? best : we;
}

void mexc_sgd_group(const int8_t *w, int32_t w_exp, int32_t *row, int32_t grad_exp, int8_t *v,
                    int32_t *v_exp, uint32_t g, uint32_t per, const mexc_update_cfg_t *cfg,
                    const uint32_t keys[9])
{
    const int32_t bits = cfg->bits, st = cfg->stochastic, b = bits - 1;
    const uint32_t base = g * per;
    /* the velocity keeps MEXC_VELOCITY_BITS at every B (docs/numerics.md section 12) */
    const int32_t mb = MEXC_VELOCITY_BITS - 1 +
                       (cfg->momentum.num ? mexc_bit_length((uint32_t)cfg->momentum.num) : 1);
    const int32_t me = v_exp[g] - cfg->momentum.shift;
    int32_t e_g = grad_exp, t;
    uint32_t i;
    /* 1. g = compact(grad_acc) per group [0] */
    compact_row_inplace(row, per, base, &e_g, bits, st, keys[0]);
    /* 2. g = compact(g + wd * w) [1, 2], [3] */
    if (cfg->weight_decay.num)
        l2_row(row, w + base, per, base, &e_g, w_exp, cfg->weight_decay, bits,
               weight_bound_bits(bits, cfg->rows), st, keys + 1);
    /* 3. v = compact(momentum * v + g) [4, 5], [6] */
    t = target2(me, mb, e_g, b);
    for (i = 0; i < per; i++)
        row[i] = mexc_shift_signed((int32_t)v[base + i] * cfg->momentum.num, t - me, st, keys[4],
                                   base + i) +
                 mexc_shift_signed(row[i], t - e_g, st, keys[5], base + i);
    v_exp[g] = compact_group(row, v + base, per, base, t, MEXC_VELOCITY_BITS, st, keys[6]);
}

/* Step 5 for element i: w_acc = w - align(lr * v to we) [7] (d = we - (e_v - lr.shift)). */
static int32_t sgd_w_acc(const int8_t *w, const int8_t *v, uint32_t i, int32_t d,
                         const mexc_update_cfg_t *cfg, uint32_t key)
{
    const int32_t u = (int32_t)v[i] * cfg->lr.num;
    const int32_t sh = d >= 0 ? mexc_shift_right(u, d, cfg->stochastic, key, i)
                              : mexc_shift_left_sat(u, -d, 30);
    return (int32_t)w[i] - sh;
}

void mexc_sgd_finish(int8_t *w, int32_t *w_exp, const int8_t *v, const int32_t *v_exp,
                     uint32_t groups, uint32_t per, const mexc_update_cfg_t *cfg,
                     const uint32_t keys[9])
{
    const int32_t bits = cfg->bits, st = cfg->stochastic;
    /* 4. an all-zero w takes the coarsest exponent of a nonzero update */
    const int32_t we = zero_weight_exponent(w, v, groups, per, v_exp, cfg->lr, *w_exp);
    const mexc_chan_t *rows = bits < 8 ? cfg->rows : NULL;
    uint32_t g, i, m = 0u, a;
    int32_t s, x, frame;
    /* 5-6. w_acc is computed twice, for its maximum and then rounded, instead of stored */
    clear_rows(rows);
    for (g = 0; g < groups; g++)
        for (i = g * per; i < (g + 1u) * per; i++) {
            x = sgd_w_acc(w, v, i, we - (v_exp[g] - cfg->lr.shift), cfg, keys[7]);
            a = mexc_uabs(x);
            if (a > m) m = a;
            if (rows) note_row(rows, i, x);
        }
    if (!(rows && mexc_channel_shifts(rows, NULL, we, bits, 1, &frame))) rows = NULL;
    s = mexc_rescale_shift(m, bits);
    for (g = 0; g < groups; g++)
        for (i = g * per; i < (g + 1u) * per; i++) {
            x = sgd_w_acc(w, v, i, we - (v_exp[g] - cfg->lr.shift), cfg, keys[7]);
            w[i] = rows ? mexc_channel_round(rows, i / rows->inner, x, bits, st, keys[8], i)
                        : mexc_rescale_one(x, s, bits, st, keys[8], i);
        }
    *w_exp = rows ? frame : we + s;
}

void mexc_sgd_momentum_update(int8_t *w, int32_t *w_exp, int32_t *grad, int32_t grad_exp,
                              int8_t *v, int32_t *v_exp, uint32_t groups, uint32_t per,
                              const mexc_update_cfg_t *cfg, const uint32_t keys[9],
                              int32_t *scratch)
{
    uint32_t g;
    (void)scratch;
    for (g = 0; g < groups; g++)
        mexc_sgd_group(w, *w_exp, grad + g * per, grad_exp, v, v_exp, g, per, cfg, keys);
    mexc_sgd_finish(w, w_exp, v, v_exp, groups, per, cfg, keys);
}

/* ------------------------------------------------------------------ AdamW (numerics 12b) */

void mexc_adamw_keys(uint32_t seed, uint32_t step, uint32_t tid_base,
                     uint32_t keys[MEXC_ADAMW_SITES])
{
    uint32_t j;
    for (j = 0; j < MEXC_ADAMW_SITES; j++) keys[j] = mexc_stream_key(seed, step, tid_base + j);
}

/* numerics.adam_ratio of one element: m / (r + eps) with MEXC_RATIO_FRAC fraction bits. */
static int32_t adam_ratio(int32_t m, int32_t r, int32_t eps_units)
{
    int32_t d = (r << MEXC_DENOM_FRAC) + eps_units, q;
    if (m == 0) return 0;
    if (d == 0) return m < 0 ? -MEXC_RATIO_CAP : MEXC_RATIO_CAP;
    /* a product, not a shift: a left shift of a negative value is undefined in C99 */
    q = mexc_idiv_round(m * (1 << (MEXC_DENOM_FRAC + MEXC_RATIO_FRAC)), (uint32_t)d);
    return q > MEXC_RATIO_CAP ? MEXC_RATIO_CAP : (q < -MEXC_RATIO_CAP ? -MEXC_RATIO_CAP : q);
}

/* Three-term per-group aligned_sum target: x + c (y - x) as (x, -x c, y c). */
static int32_t target3(int32_t e1, int32_t b1, int32_t e2, int32_t b2, int32_t e3, int32_t b3)
{
    int32_t e[3], b[3];
    e[0] = e1;
    e[1] = e2;
    e[2] = e3;
    b[0] = b1;
    b[1] = b2;
    b[2] = b3;
    return mexc_aligned_target(3u, e, b);
}

void mexc_adamw_group(const int8_t *w, int32_t w_exp, int32_t *row, int32_t grad_exp, int8_t *m,
                      int32_t *m_exp, int8_t *r, int32_t *r_exp, uint32_t g, uint32_t per,
                      const mexc_adamw_cfg_t *cfg, const uint32_t keys[MEXC_ADAMW_SITES],
                      int32_t *tmp)
{
    const int32_t bits = cfg->bits, st = cfg->stochastic, b = bits - 1;
    const mexc_fixed_t c1 = cfg->one_minus_beta1, c2 = cfg->one_minus_beta2;
    const int32_t mb = MEXC_MOMENT_BITS - 1, rb = 2 * mb;
    const int32_t cb1 = mexc_bit_length((uint32_t)c1.num), cb2 = mexc_bit_length((uint32_t)c2.num);
    const uint32_t base = g * per;
    int32_t t, k, e_g = grad_exp, em, er2, eg2;
    uint32_t i;
    /* 1. g = compact(grad_acc) per group [0]; the row then holds g */
    compact_row_inplace(row, per, base, &e_g, bits, st, keys[0]);
    /* 1b. Adam's L2 term: g = compact(g + wd * w) per group [12, 13], [14] */
    if (cfg->l2.num)
        l2_row(row, w + base, per, base, &e_g, w_exp, cfg->l2, bits,
               weight_bound_bits(bits, cfg->rows), st, keys + 12);
    /* 2. m = compact(m + c1 (g - m)) as (m, -m c1, g c1) [1, 2, 3], [4] */
    em = m_exp[g];
    t = target3(em, mb, em - c1.shift, mb + cb1, e_g - c1.shift, b + cb1);
    for (i = 0; i < per; i++) {
        int32_t mv = m[base + i];
        tmp[i] = mexc_shift_signed(mv, t - em, st, keys[1], base + i) +
                 mexc_shift_signed(-mv * c1.num, t - (em - c1.shift), st, keys[2], base + i) +
                 mexc_shift_signed(row[i] * c1.num, t - (e_g - c1.shift), st, keys[3], base + i);
    }
    m_exp[g] = compact_group(tmp, m + base, per, base, t, MEXC_MOMENT_BITS, st, keys[4]);
    /* 3. acc_v = r^2 + c2 (g^2 - r^2) as (r^2, -r^2 c2, g^2 c2) [5, 6, 7] */
    er2 = 2 * r_exp[g];
    eg2 = 2 * e_g;
    t = target3(er2, rb, er2 - c2.shift, rb + cb2, eg2 - c2.shift, 2 * b + cb2);
    for (i = 0; i < per; i++) {
        int32_t rv = r[base + i], gv = row[i];
        tmp[i] = mexc_shift_signed(rv * rv, t - er2, st, keys[5], base + i) +
                 mexc_shift_signed(-rv * rv * c2.num, t - (er2 - c2.shift), st, keys[6], base + i) +
                 mexc_shift_signed(gv * gv * c2.num, t - (eg2 - c2.shift), st, keys[7], base + i);
    }
    /* 4. r = compact(isqrt(max(acc_v, 0) << k)) [8], k = 30 or 31 so that t - k is even */
    k = 30 + ((t - 30) & 1);
    for (i = 0; i < per; i++)
        tmp[i] = tmp[i] > 0 ? (int32_t)mexc_isqrt64((uint64_t)tmp[i] << k) : 0;
    r_exp[g] = compact_group(tmp, r + base, per, base, (t - k) / 2, MEXC_MOMENT_BITS, st, keys[8]);
}

/* Step 5's epsilon in units of the group's denominator, r_exp the group's root exponent. */
static int32_t adam_eps_units(const mexc_adamw_cfg_t *cfg, int32_t r_exp)
{
    const int32_t s = cfg->eps.shift + r_exp - MEXC_DENOM_FRAC;
    return s >= 0 ? mexc_shift_right(cfg->eps.num, s, 0, 0u, 0u)
                  : mexc_shift_left_sat(cfg->eps.num, -s, 30);
}

/* Step 7 for element i: w_acc = w - align(q * lr) [9] - shift_right(w * wd, wd.shift) [10],
 * q = m / (r + eps) (step 5), d = we - (e_q - lr.shift). */
static int32_t adam_w_acc(const int8_t *w, const int8_t *m, const int8_t *r, uint32_t i,
                          int32_t eps_units, int32_t d, const mexc_adamw_cfg_t *cfg,
                          const uint32_t keys[MEXC_ADAMW_SITES])
{
    const int32_t st = cfg->stochastic, u = adam_ratio(m[i], r[i], eps_units) * cfg->lr.num;
    const int32_t sh = d >= 0 ? mexc_shift_right(u, d, st, keys[9], i)
                              : mexc_shift_left_sat(u, -d, 30);
    return (int32_t)w[i] - sh -
           mexc_shift_right((int32_t)w[i] * cfg->weight_decay.num, cfg->weight_decay.shift, st,
                            keys[10], i);
}

void mexc_adamw_finish(int8_t *w, int32_t *w_exp, const int8_t *m, const int32_t *m_exp,
                       const int8_t *r, const int32_t *r_exp, uint32_t groups, uint32_t per,
                       const mexc_adamw_cfg_t *cfg, const uint32_t keys[MEXC_ADAMW_SITES])
{
    const mexc_chan_t *rows = cfg->bits < 8 ? cfg->rows : NULL;
    int32_t we = *w_exp, found = 0, any_w = 0, s, eps_units, e_q, x, frame;
    uint32_t g, i, mx = 0u, a;
    /* 6. an all-zero w takes the coarsest exponent of a nonzero update (zero_weight_exponent) */
    for (i = 0; i < groups * per; i++)
        if (w[i] != 0) any_w = 1;
    if (!any_w && cfg->lr.num != 0) {
        int32_t best = we;
        for (g = 0; g < groups; g++) {
            eps_units = adam_eps_units(cfg, r_exp[g]);
            e_q = m_exp[g] - r_exp[g] - MEXC_RATIO_FRAC;
            for (i = g * per; i < (g + 1u) * per; i++)
                if (adam_ratio(m[i], r[i], eps_units) != 0) {
                    if (!found || e_q - cfg->lr.shift > best) best = e_q - cfg->lr.shift;
                    found = 1;
                    break;
                }
        }
        we = best;
    }
    /* 7-8. w_acc computed twice, for its maximum and then rounded [11], instead of stored */
    clear_rows(rows);
    for (g = 0; g < groups; g++) {
        const int32_t d = we - (m_exp[g] - r_exp[g] - MEXC_RATIO_FRAC - cfg->lr.shift);
        eps_units = adam_eps_units(cfg, r_exp[g]);
        for (i = g * per; i < (g + 1u) * per; i++) {
            x = adam_w_acc(w, m, r, i, eps_units, d, cfg, keys);
            a = mexc_uabs(x);
            if (a > mx) mx = a;
            if (rows) note_row(rows, i, x);
        }
    }
    if (!(rows && mexc_channel_shifts(rows, NULL, we, cfg->bits, 1, &frame))) rows = NULL;
    s = mexc_rescale_shift(mx, cfg->bits);
    for (g = 0; g < groups; g++) {
        const int32_t d = we - (m_exp[g] - r_exp[g] - MEXC_RATIO_FRAC - cfg->lr.shift);
        eps_units = adam_eps_units(cfg, r_exp[g]);
        for (i = g * per; i < (g + 1u) * per; i++) {
            x = adam_w_acc(w, m, r, i, eps_units, d, cfg, keys);
            w[i] = rows ? mexc_channel_round(rows, i / rows->inner, x, cfg->bits,
                                             cfg->stochastic, keys[11], i)
                        : mexc_rescale_one(x, s, cfg->bits, cfg->stochastic, keys[11], i);
        }
    }
    *w_exp = rows ? frame : we + s;
}

void mexc_adamw_update(int8_t *w, int32_t *w_exp, int32_t *grad, int32_t grad_exp, int8_t *m,
                       int32_t *m_exp, int8_t *r, int32_t *r_exp, uint32_t groups, uint32_t per,
                       const mexc_adamw_cfg_t *cfg, const uint32_t keys[MEXC_ADAMW_SITES],
                       int32_t *scratch)
{
    uint32_t g;
    for (g = 0; g < groups; g++)
        mexc_adamw_group(w, *w_exp, grad + g * per, grad_exp, m, m_exp, r, r_exp, g, per, cfg,
                         keys, scratch);
    mexc_adamw_finish(w, w_exp, m, m_exp, r, r_exp, groups, per, cfg, keys);
}
