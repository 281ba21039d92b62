/* mexc runtime layer kernels: the C form of the mexc/kernels modules (recipes: docs/layers.md).
 *
 * Conventions (as the numpy kernels):
 * - An MX tensor is an int8 mantissa array (C order) plus its exponent(s) (int32).
 * - Weight / bias / BN-affine gradients are int32 accumulators with one exponent.
 * - Site j of a kernel called with base id tid uses the key mexc_site_key(ctx, tid, j);
 *   tid = rid * 16 as in mexc/interp.py.
 * - Kernels with a compacted output compute their int32 accumulator twice (scan, then round),
 *   so they need no accumulator buffer; `scratch` is only for pre-shifted operands and per-channel
 *   values. Each kernel documents its scratch size in int32 words (a *_scratch function or macro).
 * - Functions that return int32_t return the output exponent.
 */
#ifndef MEXC_KERNELS_H
#define MEXC_KERNELS_H

#include "mexc_rt.h"

extern const int32_t mexc_exp_table[256];      /* numerics.EXP_TABLE.values */
extern const int32_t mexc_nll_micro_table[256]; /* round(-10^6 ln(max(i,1)/256)) */
#define MEXC_EXP_IN_EXP (-4)
#define MEXC_PROB_EXP (-15)
#define MEXC_SOFTMAX_GRAD_EXP (-15)

/* ------------------------------------------------------------------ products (_common.py) */
int32_t mexc_product_cap(uint32_t k);   /* numerics.product_cap(k, 8) */
int32_t mexc_product_bits(uint32_t k);  /* _common.product_bits: 14 + ceil_log2(max(k, 1)) */
/* Words of scratch for _common.fit_product of an n-element operand with reduction width k. */
uint32_t mexc_fit_scratch(uint32_t n, uint32_t k);
/* _common.fit_product: a pre-shifted copy of a in scratch (site key) if product_cap(k) < 0,
 * else a itself; *e grows by the shift. */
const int8_t *mexc_fit_product(const int8_t *a, uint32_t n, int32_t *e, uint32_t k,
                               const mexc_ctx_t *ctx, uint32_t key, int32_t *scratch);

/* ------------------------------------------------------------------ products
 * The loops of every convolution and linear layer (and of their gradients) are generated from
 * TVM TIR into kernels.c (mexc/lowering/mcu_products.py): `<node>_scan` (max |value|) and
 * `<node>_round` (the compacted output), or the int32 weight gradient. These two calls are the
 * bookkeeping around them (kernels/conv.py, linear.py): the operand pre-shift, the exponents,
 * the bias alignment and the compaction shift. */
typedef struct {
    int32_t e_acc;       /* exponent of the int32 accumulator */
    int32_t ta, tb;      /* bias alignment: target - e_acc, target - e_bias */
    int32_t e_val;       /* exponent of the value compacted: e_acc, or the aligned target */
    int32_t stoch, bits; /* the context's rounding */
    uint32_t k0, k1, k2; /* site keys: 0 the compaction, 1 and 2 the bias alignment */
    int32_t amax;        /* written by the scan kernel */
    int32_t s;           /* the compaction shift (mexc_product_end) */
} mexc_product_t;
/* Pre-shift operand a (n elements, reduction width k; site 3) if the product's cap needs it and
 * return the operand the kernels read; e_acc = e_a (after the shift) + e_b. has_bias: the
 * value is aligned_sum(acc, bias) (docs/numerics.md section 7). Scratch: mexc_fit_scratch. */
const int8_t *mexc_product_begin(mexc_product_t *p, const int8_t *a, uint32_t n, int32_t e_a,
                                 int32_t e_b, uint32_t k, int32_t has_bias, int32_t e_bias,
                                 const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch);
/* The compaction shift of p->amax; returns the output's exponent. */
int32_t mexc_product_end(mexc_product_t *p);
/* With channel exponents (docs/numerics.md section 5): the channel shifts of the maxima in
 * ch->word (the scan kernel's `_cscan`), packed into ch->word for the `_cround` kernel; returns
 * the frame. */
int32_t mexc_product_end_channels(mexc_product_t *p, const mexc_chan_t *ch);

/* bias_backward: dy viewed as (N, C, S) summed over N and S -> db[C] (exponent e_dy).
 * Conv: S = OH*OW; linear: S = 1. */
void mexc_bias_backward(uint32_t n, uint32_t c, uint32_t s, const int8_t *dy, int32_t *db);

/* ------------------------------------------------------------------ activations, pooling */
void mexc_relu_forward(const int8_t *x, int8_t *y, uint32_t n);
/* dx = dy where x > 0 (x = ReLU input or output) */
void mexc_relu_backward(const int8_t *dy, const int8_t *x, int8_t *dx, uint32_t n);

typedef struct {
    uint32_t n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow;
} mexc_pool_t;
void mexc_pool_init(mexc_pool_t *p, uint32_t n, uint32_t c, uint32_t h, uint32_t w, uint32_t kh,
                    uint32_t kw, uint32_t sh, uint32_t sw, uint32_t ph, uint32_t pw);
/* maxpool2d_forward: y (N, C, OH, OW) same exponent, argmax = offset i*KW + j of the first max
 * (argmax NULL: not written) */
void mexc_maxpool2d_forward(const mexc_pool_t *p, const int8_t *x, int8_t *y, uint8_t *argmax);
/* maxpool2d_backward: scatter-add of dy at argmax; exponent e_dy unless compacted (site 0). */
int32_t mexc_maxpool2d_backward(const mexc_pool_t *p, const int8_t *dy, int32_t ed,
                                const uint8_t *argmax, int8_t *dx, const mexc_ctx_t *ctx,
                                uint32_t tid);

/* ------------------------------------------------------------------ batchnorm (norm.py) */
/* BatchNormSaved: caller-owned arrays of C entries each (live from forward to backward and
 * the running update). x viewed as (N, C, S): S = H*W (4-D) or 1 (2-D). */
typedef struct {
    int8_t *xhat;      /* N*C*S */
    int32_t xhat_e;
    int32_t *rstd;     /* [C] */
    int32_t *rstd_e;   /* [C] */
    int32_t *mean;     /* [C], exponent mean_e */
    int32_t mean_e;
    int32_t *var;      /* [C] biased, exponents var_e[C] */
    int32_t *var_u;    /* [C] unbiased (M/(M-1)), exponents var_e[C] */
    int32_t *var_e;    /* [C] */
    uint32_t count;    /* M = N*S */
} mexc_bn_saved_t;

/* norm._rstd: 1/sqrt(var * 2^ev + eps) as rstd in [2^14, 2^15] at *rstd_e (BatchNorm, LayerNorm). */
int32_t mexc_rstd(int32_t var, int32_t ev, mexc_fixed_t eps, int32_t *rstd_e);
/* Scratch words of every batchnorm function (backward: plus mexc_fit_scratch(N*C*S, N*S)). */
#define MEXC_BN_SCRATCH(C) (6u * (uint32_t)(C))
/* batchnorm_forward_train. Sites 0 var pre-shift, 1 xhat, 2/3 affine alignment, 4 output.
 * y NULL: xhat and the statistics alone (a copy for the backward pass); xhat may be x. */
int32_t mexc_batchnorm_forward_train(uint32_t n, uint32_t c, uint32_t s, const int8_t *x,
                                     int32_t ex, const int8_t *gamma, int32_t eg,
                                     const int8_t *beta, int32_t eb, mexc_fixed_t eps, int8_t *y,
                                     mexc_bn_saved_t *saved, const mexc_ctx_t *ctx, uint32_t tid,
                                     int32_t *scratch);
/* batchnorm_affine: mexc_batchnorm_forward_train's y again from saved->xhat (sites 2-4 of the
 * forward's tid): the rematerialize pass's copy of a batch norm's output. Returns y's exponent. */
int32_t mexc_batchnorm_affine(uint32_t n, uint32_t c, uint32_t s, const mexc_bn_saved_t *saved,
                              const int8_t *gamma, int32_t eg, const int8_t *beta, int32_t eb,
                              int8_t *y, const mexc_ctx_t *ctx, uint32_t tid);
/* batchnorm_backward: dx (exponent *e_dx), dgamma[C] (exponent *e_dgamma), dbeta[C]
 * (exponent e_dy). dx = NULL skips the input gradient (dgamma and dbeta are unchanged). Scratch: MEXC_BN_SCRATCH(C) + mexc_fit_scratch(N*C*S, N*S). */
void mexc_batchnorm_backward(uint32_t n, uint32_t c, uint32_t s, const int8_t *dy, int32_t ed,
                             const mexc_bn_saved_t *saved, const int8_t *gamma, int32_t eg,
                             int8_t *dx, int32_t *e_dx, int32_t *dgamma, int32_t *e_dgamma,
                             int32_t *dbeta, const mexc_ctx_t *ctx, uint32_t tid,
                             int32_t *scratch);
/* The gradient a batch norm's backward reads: dense, or the gradient of a max pool with
 * non-overlapping windows (stride = kernel, no padding) that follows it, given as the pooled
 * gradient and the argmax. The pooled form is mexc_maxpool2d_backward's output read where it
 * is needed instead of stored: the same values and exponent, without the pooled layer's full
 * int8 gradient in RAM. */
typedef struct {
    const int8_t *dense;   /* the gradient, or NULL: */
    const int8_t *pooled;  /* the pool's output gradient (N, C, OH, OW) */
    const uint8_t *argmax; /* mexc_maxpool2d_forward's */
    uint32_t h, w, kh, kw, oh, ow;
    int32_t s, stoch, bits; /* the pool backward's compaction: shift, rounding */
    uint32_t key;           /* its site 0 */
} mexc_grad_src_t;
/* A dense source; a pooled one (returns the gradient's exponent, that of
 * mexc_maxpool2d_backward's output; tid: the pool backward's). */
void mexc_grad_dense(mexc_grad_src_t *g, const int8_t *dy);
int32_t mexc_grad_pooled(mexc_grad_src_t *g, const mexc_pool_t *p, const int8_t *pooled,
                         int32_t ed, const uint8_t *argmax, const mexc_ctx_t *ctx, uint32_t tid);
/* batchnorm_backward reading its gradient from a source; dense: mexc_batchnorm_backward. A
 * pooled source needs mexc_product_cap(N*S) >= 0 (no pre-shift copy of the gradient). */
void mexc_batchnorm_backward_src(uint32_t n, uint32_t c, uint32_t s, const mexc_grad_src_t *dy,
                                 int32_t ed, const mexc_bn_saved_t *saved, const int8_t *gamma,
                                 int32_t eg, int8_t *dx, int32_t *e_dx, int32_t *dgamma,
                                 int32_t *e_dgamma, int32_t *dbeta, const mexc_ctx_t *ctx,
                                 uint32_t tid, int32_t *scratch);
/* batchnorm_update_running with batch_var = saved->var_u (as mexc/interp.py). rm/rv exponents:
 * C entries if *_grouped else 1 entry. Sites 0-3 mean, 4-7 variance. */
void mexc_batchnorm_update_running(uint32_t c, int8_t *rm, int32_t *rm_e, int32_t rm_grouped,
                                   int8_t *rv, int32_t *rv_e, int32_t rv_grouped,
                                   const mexc_bn_saved_t *saved, mexc_fixed_t momentum,
                                   const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch);
/* batchnorm_forward_eval. Sites 0/1 x - rm, 2 shift to 16 bits, 3 xhat, 4/5 affine, 6 output.
 * Scratch: MEXC_BN_SCRATCH(C). */
int32_t mexc_batchnorm_forward_eval(uint32_t n, uint32_t c, uint32_t s, const int8_t *x,
                                    int32_t ex, const int8_t *gamma, int32_t eg,
                                    const int8_t *beta, int32_t eb, const int8_t *rm,
                                    const int32_t *rm_e, int32_t rm_grouped, const int8_t *rv,
                                    const int32_t *rv_e, int32_t rv_grouped, mexc_fixed_t eps,
                                    int8_t *y, const mexc_ctx_t *ctx, uint32_t tid,
                                    int32_t *scratch);

/* ------------------------------------------------------------------ loss (loss.py) */
/* softmax_ce_forward: probs (N, K) in [0, 2^15 - 1] (exponent -15). Returns the logged loss in
 * milli-nats (loss.ce_loss): round(mean over the first `valid` rows of 1000 (ln(S / 2^15) -
 * gap 2^-16)), S the row's sum of exponentials and gap its label's (loss.label_gap), ln from
 * mexc_nll_micro_table interpolated between S's top 8 bits (within 10 micro-nats a row; 0 if
 * valid == 0; saturated at 2^31 - 1). Site 0. */
int32_t mexc_softmax_ce_forward(uint32_t n, uint32_t k, const int8_t *logits, int32_t e,
                                const int32_t *labels, uint32_t valid, int16_t *probs,
                                const mexc_ctx_t *ctx, uint32_t tid);
/* softmax_ce_backward: dlogits (N, K); returns its exponent. Site 0. */
int32_t mexc_softmax_ce_backward(uint32_t n, uint32_t k, const int16_t *probs,
                                 const int32_t *labels, uint32_t valid, int8_t *dx,
                                 const mexc_ctx_t *ctx, uint32_t tid);

/* ------------------------------------------------------------------ elementwise */
/* concat along one axis, input i seen as (outer, k[i] * inner): site 0 alignment, site 1
   compaction (docs/layers.md). */
int32_t mexc_concat(uint32_t t, const int8_t *const *x, const int32_t *e, const uint32_t *k,
                    uint32_t outer, uint32_t inner, int8_t *out, const mexc_ctx_t *ctx,
                    uint32_t tid);
/* x * g, x seen as (o, m, inner) and g as (m,): compaction site 0 (docs/layers.md). */
int32_t mexc_mul_forward(const int8_t *x, int32_t ex, const int8_t *g, int32_t eg, uint32_t o,
                         uint32_t m, uint32_t inner, int8_t *out, const mexc_ctx_t *ctx,
                         uint32_t tid);
/* a / b of n elements each (the mantissas' quotient to 2^-MEXC_DIV_BITS; b's 0 as half a unit),
   compacted (site 0). Returns the result's exponent. */
#define MEXC_DIV_BITS 15 /* kernels.elementwise.DIV_BITS: the bit-exact tests hold them equal */
int32_t mexc_div_forward(const int8_t *a, int32_t ea, const int8_t *b, int32_t eb, uint32_t n,
                         int8_t *out, const mexc_ctx_t *ctx, uint32_t tid);
/* dg of x * g into acc (m int32): pre-shift t (site 1); out NULL: acc is the result, else
   compacted into out (site 0). Returns the result's exponent. */
int32_t mexc_mul_backward_factor(const int8_t *dy, int32_t ed, const int8_t *x, int32_t ex,
                                 uint32_t o, uint32_t m, uint32_t inner, uint32_t t,
                                 int32_t *acc, int8_t *out, const mexc_ctx_t *ctx, uint32_t tid);
/* grad_sum of t <= 13 same-shape tensors (sites 0..t-1 alignment, t compaction); t = 1 copies. */
int32_t mexc_grad_sum(uint32_t t, const int8_t *const *x, const int32_t *e, uint32_t n,
                      int8_t *out, const mexc_ctx_t *ctx, uint32_t tid);
/* param_grad_sum of t <= 13 int32 accumulators into out (sites 0..t-1); returns its exponent. */
int32_t mexc_param_grad_sum(uint32_t t, const int32_t *const *x, const int32_t *e, uint32_t n,
                            int32_t *out, const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_add_forward(const int8_t *a, int32_t ea, const int8_t *b, int32_t eb, uint32_t n,
                         int8_t *out, const mexc_ctx_t *ctx, uint32_t tid);

/* ------------------------------------------------------------------ mexc_kernels_extra.c */
/* relu6 (activation.py): cap = relu6_cap(e) = largest mantissa c with c 2^e <= 6, <= 127.
 * y (or dx) may alias x (or dy). x of the backward: the ReLU6 input or output (exponent e). */
int32_t mexc_relu6_cap(int32_t e);
void mexc_relu6_forward(const int8_t *x, int32_t e, int8_t *y, uint32_t n);
void mexc_relu6_backward(const int8_t *dy, const int8_t *x, int32_t e, int8_t *dx, uint32_t n);
/* hardswish (activation.py): y = x relu6(x + 3) / 6 and dx = dy g(x) on the 2^-k grid,
 * k = clamp(-e, 0, 16); compact_to_bits(., 15) (site 0), div_const by 6, compaction (site 1).
 * Return the result's exponent. */
/* activation.clamp_*: bounds = {has_lo, lo_num, lo_shift, has_hi, hi_num, hi_shift} (clamp_bound
 * pairs); top: the largest activation mantissa; the gradient passes where lo < x < hi. */
void mexc_clamp_forward(const int8_t *x, int32_t e, uint32_t n, const int32_t *bounds,
                        int32_t top, int8_t *y);
void mexc_clamp_backward(const int8_t *dy, const int8_t *x, int32_t e, uint32_t n,
                         const int32_t *bounds, int8_t *dx);
/* Nearest upsampling by (sh, sw) of `planes` (N C) h x w planes (pool.upsample_nearest_*): the
 * backward sums each block of dy, compaction site 0. */
void mexc_upsample_nearest_forward(uint32_t planes, uint32_t h, uint32_t w, uint32_t sh,
                                   uint32_t sw, const int8_t *x, int8_t *y);
int32_t mexc_upsample_nearest_backward(uint32_t planes, uint32_t h, uint32_t w, uint32_t sh,
                                       uint32_t sw, const int8_t *dy, int32_t ed, int8_t *dx,
                                       const mexc_ctx_t *ctx, uint32_t tid);
/* LeakyReLU (activation.leaky_relu_*): y = x 2^shift where mask > 0, x num elsewhere, at
 * e - shift, compaction site 0. Forward: mask = x; backward: x = dy, mask = the saved value. */
int32_t mexc_leaky_relu(const int8_t *x, int32_t e, const int8_t *mask, uint32_t n, int32_t num,
                        int32_t shift, int8_t *y, const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_hardswish_forward(const int8_t *x, int32_t e, uint32_t n, int8_t *y,
                               const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_hardswish_backward(const int8_t *dy, int32_t ed, const int8_t *x, int32_t e,
                                uint32_t n, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid);
/* hardsigmoid_forward / backward (activation.py): _divide_by_six, sites 0, 1. */
int32_t mexc_hardsigmoid_forward(const int8_t *x, int32_t e, uint32_t n, int8_t *y,
                                 const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_hardsigmoid_backward(const int8_t *dy, int32_t ed, const int8_t *x, int32_t e,
                                  uint32_t n, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid);
/* avgpool2d (pool.py, count_include_pad): sites 0 (compact_to_bits of the sums, only when
 * 7 + ceil log2(KH*KW) > 15), 1 compaction. Backward: site 0. No scratch. */
int32_t mexc_avgpool2d_forward(const mexc_pool_t *p, const int8_t *x, int32_t e, int8_t *y,
                               const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_avgpool2d_backward(const mexc_pool_t *p, const int8_t *dy, int32_t ed, int8_t *dx,
                                const mexc_ctx_t *ctx, uint32_t tid);
/* Mean over the middle axis of x viewed as (outer, T, inner) -> (outer, inner): pool._divide
 * (sites 0, 1). Backward: dx (outer, T, inner) = broadcast div_const(dy << 8, T), site 0.
 * global_avgpool: (N*C, H*W, 1); transformer.mean_tokens: (B, T, D). */
int32_t mexc_mean_axis_forward(uint32_t outer, uint32_t t, uint32_t inner, const int8_t *x,
                               int32_t e, int8_t *y, const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_mean_axis_backward(uint32_t outer, uint32_t t, uint32_t inner, const int8_t *dy,
                                int32_t ed, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_global_avgpool_forward(uint32_t n, uint32_t c, uint32_t s, const int8_t *x,
                                    int32_t e, int8_t *y, const mexc_ctx_t *ctx, uint32_t tid);
int32_t mexc_global_avgpool_backward(uint32_t n, uint32_t c, uint32_t s, const int8_t *dy,
                                     int32_t ed, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid);
/* dropout (elementwise.py): mask[i] = rand(site 0, i / per) < 2^32 - drop (all kept if drop == 0;
 * per: elements per decision, 1, or a sample for stochastic depth),
 * drop = round-down(p 2^32) and scale = FixedScalar.of(1/(1-p)) are host constants;
 * y = compact(mask m scale.num) at e - scale.shift (site 1). Backward: site 0. */
int32_t mexc_dropout_forward(const int8_t *x, int32_t e, uint32_t n, uint32_t drop,
                             mexc_fixed_t scale, int8_t *y, uint8_t *mask, const mexc_ctx_t *ctx,
                             uint32_t tid, uint32_t per);
int32_t mexc_dropout_backward(const int8_t *dy, int32_t ed, const uint8_t *mask, uint32_t n,
                              mexc_fixed_t scale, int8_t *dx, const mexc_ctx_t *ctx, uint32_t tid);

/* ------------------------------------------------------------------ mexc_kernels_transformer.c */
#define MEXC_MAX_DIMS 8u

/* LayerNormSaved over R rows of D: caller-owned xhat (R*D) and rstd / rstd_e (R each). */
typedef struct {
    int8_t *xhat;
    int32_t xhat_e;
    int32_t *rstd;
    int32_t *rstd_e;
    uint32_t rows, d;
} mexc_ln_saved_t;
#define MEXC_LN_SCRATCH(R) (5u * (uint32_t)(R))
/* layernorm_forward over the last axis (groups = per = 1), or GroupNorm: rows (sample,
 * group) of D = C/G x per elements, gamma and beta per channel. Sites 0 variance pre-shift, 1
 * xhat, 2/3 affine alignment, 4 output. Scratch: MEXC_LN_SCRATCH(R). */
int32_t mexc_layernorm_forward(uint32_t rows, uint32_t d, const int8_t *x, int32_t ex,
                               const int8_t *gamma, int32_t eg, const int8_t *beta, int32_t eb,
                               mexc_fixed_t eps, int8_t *y, mexc_ln_saved_t *sv,
                               const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch,
                               uint32_t groups, uint32_t per);
/* layernorm_backward: dx (exponent *e_dx; NULL skips it), dgamma and dbeta per parameter
 * (*e_dgamma; e_dy). Sites 0-7 as the reference. Scratch: MEXC_LN_SCRATCH(R) +
 * mexc_fit_scratch(R*D, R / groups * per). */
void mexc_layernorm_backward(uint32_t rows, uint32_t d, const int8_t *dy, int32_t ed,
                             const mexc_ln_saved_t *sv, const int8_t *gamma, int32_t eg,
                             int8_t *dx, int32_t *e_dx, int32_t *dgamma, int32_t *e_dgamma,
                             int32_t *dbeta, const mexc_ctx_t *ctx, uint32_t tid,
                             int32_t *scratch, uint32_t groups, uint32_t per);
/* activation.table_product: a (NULL: none) times a 256-entry table of x (sites 0, 1); sigmoid,
   SiLU, tanh, Mish, the activation offsets and their gradients, with the tables the generated
   program defines (sign_exact: LookupTable.sign_exact, a positive x reads index 1 or more). */
int32_t mexc_table_product(const int8_t *a, int32_t ea, const int8_t *x, int32_t ex,
                           const int32_t *tab, int32_t in_exp, int32_t out_exp,
                           int32_t sign_exact, uint32_t n, int8_t *out, const mexc_ctx_t *ctx,
                           uint32_t tid);
/* Row softmax over the last axis (rows x K): p in [0, qmax(B)] at exponent -(B-1) (returned).
 * Sites 0 exp index, 1 normalization. Backward (p = softmax output): sites 1-5; scratch
 * mexc_softmax_backward_scratch. */
int32_t mexc_softmax_forward(uint32_t rows, uint32_t k, const int8_t *x, int32_t e, int8_t *p,
                             const mexc_ctx_t *ctx, uint32_t tid);
/* The same over rows of tq queries (rows = groups x tq) with the keys after each query hidden
 * (kernels.softmax_forward(causal=True)). */
int32_t mexc_softmax_causal_forward(uint32_t rows, uint32_t k, uint32_t tq, const int8_t *x,
                                    int32_t e, int8_t *p, const mexc_ctx_t *ctx, uint32_t tid);
/* The same (tq = 0: not causal) with key j of every row of sample n also hidden where
 * ids[n k + j] cmp value (ids: samples x k token ids; cmp a MEXC_KEY_* comparison); a row with
 * every key hidden gets p = 0 (kernels.softmax_forward(hidden_keys=...)). */
enum { MEXC_KEY_EQ, MEXC_KEY_NE, MEXC_KEY_LT, MEXC_KEY_LE, MEXC_KEY_GT, MEXC_KEY_GE };
int32_t mexc_softmax_masked_forward(uint32_t rows, uint32_t k, uint32_t tq, const int32_t *ids,
                                    uint32_t samples, int32_t cmp, int32_t value, const int8_t *x,
                                    int32_t e, int8_t *p, const mexc_ctx_t *ctx, uint32_t tid);
uint32_t mexc_softmax_backward_scratch(uint32_t rows, uint32_t k);
int32_t mexc_softmax_backward(uint32_t rows, uint32_t k, const int8_t *dy, int32_t ed,
                              const int8_t *p, int32_t ep, int8_t *dx, const mexc_ctx_t *ctx,
                              uint32_t tid, int32_t *scratch);
/* Batched matmul: a (batch, M, K) @ b (batch, K, N) -> y (batch, M, N). Sites 0, 3. */
uint32_t mexc_matmul_forward_scratch(uint32_t batch, uint32_t m, uint32_t k);
int32_t mexc_matmul_forward(uint32_t batch, uint32_t m, uint32_t k, uint32_t n, const int8_t *a,
                            int32_t ea, const int8_t *b, int32_t eb, int8_t *y,
                            const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch);
/* da = dy @ b^T (sites 2, 0), db = a^T @ dy (sites 3, 1); NULL skips either. */
uint32_t mexc_matmul_backward_scratch(uint32_t batch, uint32_t m, uint32_t k, uint32_t n);
void mexc_matmul_backward(uint32_t batch, uint32_t m, uint32_t k, uint32_t n, const int8_t *dy,
                          int32_t ed, const int8_t *a, int32_t ea, const int8_t *b, int32_t eb,
                          int8_t *da, int32_t *e_da, int8_t *db, int32_t *e_db,
                          const mexc_ctx_t *ctx, uint32_t tid, int32_t *scratch);
/* y = x s (s = num 2^-shift), compaction site 0 (also the backward, on dy). */
int32_t mexc_scale_forward(const int8_t *x, int32_t e, uint32_t n, mexc_fixed_t s, int8_t *y,
                           const mexc_ctx_t *ctx, uint32_t tid);
/* y = x + p, x seen as (outer, mid, inner), p as (mid,) (a positional embedding: (batch,
 * per, 1); a bias per channel: (N, C, H W)): sites 0 (x), 1 (p, index = its own), 2
 * compaction. The parameter gradient is mexc_bias_backward(outer, mid, inner, dy, dp). */
int32_t mexc_add_broadcast_forward(const int8_t *x, int32_t ex, const int8_t *p, int32_t ep,
                                   uint32_t outer, uint32_t mid, uint32_t inner, int8_t *y,
                                   const mexc_ctx_t *ctx, uint32_t tid);
/* y = x.transpose(perm) (C order), ndim <= MEXC_MAX_DIMS; exponent unchanged. */
void mexc_transpose(const int8_t *x, int8_t *y, uint32_t ndim, const uint32_t *shape,
                    const uint32_t *perm);
/* x viewed as (outer, dim_in, inner): y = x[:, start:start+dim_out, :]; backward zero-fills. */
void mexc_slice_forward(uint32_t outer, uint32_t dim_in, uint32_t start, uint32_t dim_out,
                        uint32_t inner, const int8_t *x, int8_t *y);
void mexc_slice_backward(uint32_t outer, uint32_t dim_in, uint32_t start, uint32_t dim_out,
                         uint32_t inner, const int8_t *dy, int8_t *dx);

#endif /* MEXC_KERNELS_H */
