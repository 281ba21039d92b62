/* The 4-element int8 dot product that the TIR product kernels tensorize to (the DOT4
 * intrinsic of mexc/lowering/mcu_products.py): acc + a[0]b[0] + a[1]b[1] + a[2]b[2] + a[3]b[3],
 * exact (the accumulator caps of docs/numerics.md section 6 bound every partial sum).
 *
 * On a core with the DSP extension (Cortex-M4, M7, M33) it is two SMLAD dual 16-bit
 * multiply-accumulates on the bytes sign-extended in pairs by SXTB16 (ACLE intrinsics): one
 * word load per operand instead of four byte loads, two MACs per instruction. Elsewhere
 * (Cortex-M0, M3, the host) four multiply-accumulates in C. Both read 4 bytes that need not be
 * aligned (ARMv7E-M loads words at any address). */
#ifndef MEXC_SIMD_H
#define MEXC_SIMD_H
#include <stdint.h>

#if defined(__ARM_FEATURE_DSP) && __ARM_FEATURE_DSP
#include <arm_acle.h>

static inline uint32_t mexc_load4(const void *p)
{
    uint32_t v;
    __builtin_memcpy(&v, p, 4u); /* one LDR; a builtin even under -fno-builtin */
    return v;
}

/* SXTB16 with its rotate operand (ACLE has none: __sxtb16(ror) costs a separate ROR) */
static inline uint32_t mexc_sxtb16_ror8(uint32_t v)
{
    uint32_t r;
    __asm__("sxtb16 %0, %1, ror #8" : "=r"(r) : "r"(v));
    return r;
}

static inline int32_t mexc_dot4(const void *a, const void *b, int32_t acc)
{
    const uint32_t va = mexc_load4(a), vb = mexc_load4(b);
    /* bytes 0 and 2, then 1 and 3, as two signed halfwords each */
    acc = __smlad(__sxtb16(va), __sxtb16(vb), acc);
    return __smlad(mexc_sxtb16_ror8(va), mexc_sxtb16_ror8(vb), acc);
}
#else
static inline int32_t mexc_dot4(const void *a, const void *b, int32_t acc)
{
    const int8_t *x = (const int8_t *)a, *y = (const int8_t *)b;
    return acc + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
}
#endif

#endif
