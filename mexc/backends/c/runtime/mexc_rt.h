/* mexc runtime: integer primitives, bit-exact with mexc/numerics.py (spec: docs/numerics.md).
 *
 * Plain C99, no floating point, no malloc, no recursion, no libc. Only 32-bit arithmetic except
 * where the reference needs more (documented per function); 32-bit division only, so a
 * Cortex-M0 needs __aeabi_uidiv (and __aeabi_uldivmod for mexc_recip_of / mexc_isqrt64 only).
 * Assumes two's complement with arithmetic right shift of negative values (gcc, clang).
 */
#ifndef MEXC_RT_H
#define MEXC_RT_H

#include <stddef.h>
#include <stdint.h>

#define MEXC_SITES_PER_NODE 16u /* mexc.mx.SITES_PER_NODE: tid = rid * 16, site j -> tid + j */
#define MEXC_GOLDEN32 0x9E3779B9u

/* Channel exponents (docs/numerics.md section 5): where a result groups its values. Channel c
 * of flat element i is (i / inner) % c. word[c] (c words of the caller's) holds max |v| of the
 * channel while it is scanned, then its two shifts packed (mexc_channel_shifts): the rounding
 * shift t_c - e_c as int16 in the low half (< 0: an exact left shift, weights only) and the
 * exact left shift t_c - F into the int8 frame F in the high half. One word per channel: an
 * MCU's RAM. */
typedef struct {
    uint32_t c, inner;
    uint32_t *word;
} mexc_chan_t;

/* How a training step rounds (mexc.mx.RoundCtx). */
typedef struct {
    uint32_t seed;
    uint32_t step;
    int32_t bits;       /* mantissa bits B in 2..8 */
    int32_t stochastic; /* 1: stochastic rounding, 0: nearest (round half up) */
    /* the current call's batch-major results with channel exponents, by the kernel's result
     * slot (0, 1); NULL: one exponent per tensor (8 bits, or channel exponents off) */
    const mexc_chan_t *chan;
} mexc_ctx_t;

/* ------------------------------------------------------------------ PRNG (numerics.mix32 ...) */
uint32_t mexc_mix32(uint32_t x);                                     /* numerics.mix32 */
uint32_t mexc_stream_key(uint32_t seed, uint32_t step, uint32_t tid); /* numerics.stream_key */
uint32_t mexc_rand(uint32_t key, uint32_t idx);                      /* numerics.random_bits */
uint32_t mexc_site_key(const mexc_ctx_t *ctx, uint32_t tid, uint32_t j); /* ctx.key(tid + j) */

/* ------------------------------------------------------------------ small helpers */
int32_t mexc_qmax(int32_t bits);        /* 2^(B-1) - 1 */
int32_t mexc_bit_length(uint32_t v);    /* bits of v (0 for 0) */
int32_t mexc_ceil_log2(uint32_t n);     /* numerics.ceil_log2 (n >= 1) */
uint32_t mexc_uabs(int32_t x);          /* |x| as uint32 (2^31 for INT32_MIN) */
int8_t mexc_saturate(int32_t x, int32_t bits); /* numerics.saturate */
void mexc_fill32(int32_t *p, int32_t v, uint32_t n);

/* ------------------------------------------------------------------ shifts */
/* numerics.shift_right for one element (x int32, s >= 0, idx = flat element index). */
int32_t mexc_shift_right(int32_t x, int32_t s, int32_t stoch, uint32_t key, uint32_t idx);
int32_t mexc_shift_left(int32_t x, int32_t s);  /* exact; caller guarantees the fit */
/* numerics.shift_signed: s > 0 rounded right shift, s < 0 exact left shift. */
int32_t mexc_shift_signed(int32_t x, int32_t s, int32_t stoch, uint32_t key, uint32_t idx);
/* numerics.shift_left_saturating (s >= 0), including its int64 wrap for s > ~54-bitlen. */
int32_t mexc_shift_left_sat(int32_t x, int32_t s, int32_t limit_bits);
/* numerics.shift_signed_saturating (LookupTable index path). */
int32_t mexc_shift_signed_sat(int32_t x, int32_t s, int32_t stoch, uint32_t key, uint32_t idx);

/* ------------------------------------------------------------------ compaction */
int32_t mexc_compaction_shift(uint32_t max_abs, int32_t bits); /* numerics.compaction_shift */
uint32_t mexc_max_abs(const int32_t *x, uint32_t n);
/* numerics.compact per tensor: out = sat(shift_right(acc, s)), returns e + s. */
int32_t mexc_compact(const int32_t *acc, int8_t *out, uint32_t n, int32_t e, int32_t bits,
                     int32_t stoch, uint32_t key);
/* numerics.compact(grouped=True): acc (G, per), e_in[G] -> out, e_out[G] (may alias e_in). */
void mexc_compact_grouped(const int32_t *acc, int8_t *out, uint32_t groups, uint32_t per,
                          const int32_t *e_in, int32_t *e_out, int32_t bits, int32_t stoch,
                          uint32_t key);
/* numerics.compact_to_bits: out = shift_right(x, s) with the smallest s such that
 * max|x| <= 2^mag_bits * 2^s; returns s (exponent grows by s). out may alias x. */
int32_t mexc_compact_to_bits(const int32_t *x, int32_t *out, uint32_t n, int32_t mag_bits,
                             int32_t stoch, uint32_t key);

/* numerics.channel_shifts: from the maxima in ch->word and the accumulator's exponent (e_c[c],
 * or e for every channel when e_c is NULL) pack each channel's shifts into ch->word and return 1
 * with *frame = F; 0 when every channel is zero (the words stay 0, the caller's plain rule
 * applies). signed_: the reactive rescale's signed natural shift (weights), else
 * compaction_shift. */
int32_t mexc_channel_shifts(const mexc_chan_t *ch, const int32_t *e_c, int32_t e, int32_t bits,
                            int32_t signed_, int32_t *frame);
/* One element of channel_compact with its channel's packed shifts: saturate(shift_signed(v,
 * right), B) << up. */
int8_t mexc_frame_round(int32_t v, uint32_t word, int32_t bits, int32_t stoch, uint32_t key,
                        uint32_t idx);
/* mexc_frame_round with channel c's shifts. */
int8_t mexc_channel_round(const mexc_chan_t *ch, uint32_t c, int32_t v, int32_t bits,
                          int32_t stoch, uint32_t key, uint32_t idx);
/* The scan of a generated product with channel exponents: *amax_c = max(*amax_c, |v|);
 * returns 0 (the scan kernel stores it into the output, which the round kernel overwrites). */
int8_t mexc_chan_note(void *amax_c, int32_t v);
void mexc_chan_zero(const mexc_chan_t *ch); /* every channel maximum 0 */

/* ------------------------------------------------------------------ aligned sum */
/* Target exponent of numerics.aligned_sum for m terms with exponents e[i] and bounds b[i]:
 * max(min e_i, max(e_i + b_i) + c - 31), c = bit_length(m) for m >= 2, 0 for m = 1. */
int32_t mexc_aligned_target(uint32_t m, const int32_t *e, const int32_t *b);
/* numerics.aligned_sum of m same-shape terms x[i] (n elements, per-tensor exponents):
 * out[k] = sum_i shift_signed(x_i[k], target - e_i, key_i, k). Returns the target. */
int32_t mexc_aligned_sum(uint32_t m, const int32_t *const *x, const int32_t *e, const int32_t *b,
                         int32_t *out, uint32_t n, int32_t stoch, const uint32_t *keys);

/* ------------------------------------------------------------------ divide by constant */
typedef struct {
    uint32_t divisor, pow2, odd, mult, shift;
} mexc_recip_t;
mexc_recip_t mexc_recip_of(uint32_t divisor);              /* numerics.Reciprocal.of */
int32_t mexc_div_const(int32_t x, const mexc_recip_t *r); /* numerics.div_const; e -= pow2 */

/* ------------------------------------------------------------------ sqrt and division */
uint32_t mexc_isqrt32(uint32_t n); /* floor(sqrt(n)), digit by digit */
uint32_t mexc_isqrt64(uint64_t n); /* floor(sqrt(n)), n < 2^64 */
int32_t mexc_idiv_round(int32_t a, uint32_t b); /* numerics.idiv_round, b > 0 */
int32_t mexc_idiv_floor(int32_t a, uint32_t b); /* numerics.idiv_floor, b > 0 */

/* ------------------------------------------------------------------ weight update */
typedef struct {
    int32_t num, shift; /* numerics.FixedScalar: value = num * 2^-shift */
} mexc_fixed_t;

typedef struct {
    int32_t bits;
    int32_t stochastic;
    mexc_fixed_t lr, momentum, weight_decay;
    const mexc_chan_t *rows; /* the weight's rows with channel exponents (section 5), or NULL */
} mexc_update_cfg_t;

#define MEXC_UPDATE_SITES 9u
#define MEXC_VELOCITY_BITS 8 /* mexc.numerics.VELOCITY_BITS: velocity mantissas at every B */
void mexc_update_keys(uint32_t seed, uint32_t step, uint32_t tid_base, uint32_t keys[9]);
/* numerics.sgd_momentum_update steps 1-3 for group g alone: row (its int32 gradient, exponent
 * grad_exp; DESTROYED) -> the group's velocity v[g*per ..] and v_exp[g]. w and w_exp are read. */
void mexc_sgd_group(const int8_t *w, int32_t w_exp, int32_t *row, int32_t grad_exp, int8_t *v,
                    int32_t *v_exp, uint32_t g, uint32_t per, const mexc_update_cfg_t *cfg,
                    const uint32_t keys[9]);
/* Steps 4-6 once every group's velocity is new: the weight and *w_exp. No buffer: w_acc is
 * computed twice (its maximum, then rounded). */
void mexc_sgd_finish(int8_t *w, int32_t *w_exp, const int8_t *v, const int32_t *v_exp,
                     uint32_t groups, uint32_t per, const mexc_update_cfg_t *cfg,
                     const uint32_t keys[9]);
/* The reactive rescale (numerics section 12, step 6): the shift for max |w_acc| = m (> 0 right,
 * rounded; < 0 left, exact; 0 none), then one element. */
int32_t mexc_rescale_shift(uint32_t m, int32_t bits);
int8_t mexc_rescale_one(int32_t x, int32_t s, int32_t bits, int32_t stoch, uint32_t key,
                        uint32_t i);
/* Scratch (int32 words) of mexc_sgd_momentum_update for G groups: none. */
#define MEXC_SGD_SCRATCH(G) (0u * (uint32_t)(G)) /* none since the groups stream */
/* numerics.sgd_momentum_update: mexc_sgd_group for every group, then mexc_sgd_finish. w (G*per)
 * int8 with exponent *w_exp (updated); grad_acc int32 (G*per) with exponent grad_exp --
 * DESTROYED (the groups' work rows); v (G*per) int8 and v_exp[G] updated in place. keys from
 * mexc_update_keys. */
void mexc_sgd_momentum_update(int8_t *w, int32_t *w_exp, int32_t *grad_acc, int32_t grad_exp,
                              int8_t *v, int32_t *v_exp, uint32_t groups, uint32_t per,
                              const mexc_update_cfg_t *cfg, const uint32_t keys[9],
                              int32_t *scratch);
/* Integer AdamW (docs/numerics.md section 12b). */
typedef struct {
    int32_t bits;
    int32_t stochastic;
    mexc_fixed_t one_minus_beta1, one_minus_beta2; /* static */
    mexc_fixed_t lr, eps, weight_decay;           /* lr_t, eps_t, wd_t of the step */
    mexc_fixed_t l2; /* Adam's coupled decay (step 1b), static; AdamW: {0, 0} */
    const mexc_chan_t *rows; /* the weight's rows with channel exponents (section 5), or NULL */
} mexc_adamw_cfg_t;

#define MEXC_ADAMW_SITES 15u
#define MEXC_MOMENT_BITS 8  /* numerics.MOMENT_BITS */
#define MEXC_RATIO_FRAC 7   /* numerics.RATIO_FRAC */
#define MEXC_DENOM_FRAC 8   /* numerics.DENOM_FRAC */
#define MEXC_RATIO_CAP (16 << MEXC_RATIO_FRAC) /* numerics.RATIO_CAP */
void mexc_adamw_keys(uint32_t seed, uint32_t step, uint32_t tid_base,
                     uint32_t keys[MEXC_ADAMW_SITES]);
/* Scratch (int32 words) of mexc_adamw_update and mexc_adamw_group: one group's row. */
#define MEXC_ADAMW_SCRATCH(G, per) (0u * (uint32_t)(G) + (uint32_t)(per))
/* numerics.adamw_update steps 1-4 for group g alone: row (its int32 gradient, exponent
 * grad_exp; DESTROYED) -> the group's moments m, r and their exponents. tmp: per int32. */
void mexc_adamw_group(const int8_t *w, int32_t w_exp, int32_t *row, int32_t grad_exp, int8_t *m,
                      int32_t *m_exp, int8_t *r, int32_t *r_exp, uint32_t g, uint32_t per,
                      const mexc_adamw_cfg_t *cfg, const uint32_t keys[MEXC_ADAMW_SITES],
                      int32_t *tmp);
/* Steps 5-8 once every group's moments are new: the weight and *w_exp, the ratio and w_acc
 * computed again where needed instead of stored. */
void mexc_adamw_finish(int8_t *w, int32_t *w_exp, const int8_t *m, const int32_t *m_exp,
                       const int8_t *r, const int32_t *r_exp, uint32_t groups, uint32_t per,
                       const mexc_adamw_cfg_t *cfg, const uint32_t keys[MEXC_ADAMW_SITES]);
/* numerics.adamw_update: mexc_adamw_group for every group, then mexc_adamw_finish. w (G*per)
 * int8 with exponent *w_exp (updated); grad_acc int32 (G*per) with exponent grad_exp --
 * DESTROYED (the groups' rows); m, r (G*per) int8 and m_exp[G],
 * r_exp[G] updated in place. keys from mexc_adamw_keys. */
void mexc_adamw_update(int8_t *w, int32_t *w_exp, int32_t *grad_acc, int32_t grad_exp, int8_t *m,
                       int32_t *m_exp, int8_t *r, int32_t *r_exp, uint32_t groups, uint32_t per,
                       const mexc_adamw_cfg_t *cfg, const uint32_t keys[MEXC_ADAMW_SITES],
                       int32_t *scratch);
/* numerics.reactive_rescale: w_acc (n) -> w (int8); returns the new exponent. */
int32_t mexc_reactive_rescale(const int32_t *w_acc, int8_t *w, uint32_t n, int32_t w_exp,
                              int32_t bits, int32_t stoch, uint32_t key);

/* ------------------------------------------------------------------ checksum */
#define MEXC_FNV64_OFFSET 0xCBF29CE484222325ull
uint64_t mexc_fnv1a64(const void *data, uint32_t nbytes, uint64_t h);
/* exponents hashed as int32 little-endian (independent of the host byte order) */
uint64_t mexc_fnv1a64_i32(const int32_t *e, uint32_t n, uint64_t h);
/* 16 lowercase hex digits + NUL into out[17] */
void mexc_hex64(uint64_t h, char out[17]);

/* ------------------------------------------------------------------ two-pass compaction sink
 * Kernels produce their int32 accumulator element by element twice instead of storing it:
 * pass 0 collects max|acc| (per tensor or per channel), pass 1 rounds with the final shift.
 * The PRNG index is the flat element index, so the order of production does not matter. */
typedef struct {
    int32_t pass;      /* 0: scan, 1: write */
    int32_t stoch;
    int32_t bits;
    uint32_t key;
    uint32_t amax;     /* per tensor max (pass 0) */
    int32_t shift;     /* per tensor shift (pass 1) */
    uint32_t *camax;   /* per channel max (compact_common) or NULL */
    int32_t *cshift;   /* per channel shift (compact_common) or NULL */
    int8_t *out;
    const mexc_chan_t *chan; /* channel exponents (ctx->chan[slot]) or NULL */
    uint32_t through;  /* with chan: a result whose max |v| is at most this passes unrounded */
    /* with chan, the channel of element `next` and the elements left in its run: puts in flat
     * order need no division (an FPU-less core often has no divider either) */
    uint32_t next, ch, left;
} mexc_sink_t;

/* slot: the kernel's result slot in ctx->chan of a batch-major result (compact_mx(batch=True),
 * compact_common(batch=True) along axis 1), or -1 for a result that keeps one exponent. */
void mexc_sink_init(mexc_sink_t *k, int8_t *out, const mexc_ctx_t *ctx, uint32_t key,
                    uint32_t *camax, int32_t *cshift, uint32_t channels, int32_t slot);
void mexc_sink_put(mexc_sink_t *k, uint32_t idx, uint32_t ch, int32_t v);
/* After pass 0, per tensor: fix the shift, return e + s. */
int32_t mexc_sink_finish(mexc_sink_t *k, int32_t e);
/* After pass 0, compact_common: e_c[channels] -> per-channel shifts; returns E. */
int32_t mexc_sink_finish_common(mexc_sink_t *k, const int32_t *e_c, uint32_t channels);

#endif /* MEXC_RT_H */
