/* Cortex-M startup for every board (its linker script: board/BOARD.ld): vector table, .data/.bss
 * setup, ARM semihosting for output and exit (bkpt 0xAB: QEMU, or a board under a debug probe),
 * and the memcpy / memset / memmove that GCC may call. No libc. */
#include <stddef.h>
#include <stdint.h>

extern uint32_t __data_load, __data_start, __data_end, __bss_start, __bss_end, __stack_top;
int main(void);

static int semihost(int op, const void *arg)
{
    register int r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
    return r0;
}

void mexc_io_puts(const char *s)
{
    semihost(0x04 /* SYS_WRITE0 */, s);
}

static void semihost_exit(int ok)
{
    register int r0 __asm__("r0") = 0x18; /* SYS_EXIT */
    register int r1 __asm__("r1") = ok ? 0x20026 : 0x20023;
    __asm__ volatile("bkpt 0xAB" ::"r"(r0), "r"(r1));
    for (;;) {
    }
}

/* Instruction counts (docs/mcu.md, "Instructions per step"). Under QEMU's -icount shift=S
 * every instruction advances the virtual clock by 2^S ns, and SysTick counts that clock at
 * the core clock, MEXC_SYSTICK_HZ: instructions = ticks * 10^9 / (MEXC_SYSTICK_HZ * 2^S), to
 * within one tick's worth. Each wrap of the 24-bit counter interrupts and is counted. */
#if defined(MEXC_SYSTICK_HZ) && defined(MEXC_ICOUNT_SHIFT)
#define SYST_CSR (*(volatile uint32_t *)0xE000E010u)
#define SYST_RVR (*(volatile uint32_t *)0xE000E014u)
#define SYST_CVR (*(volatile uint32_t *)0xE000E018u)
#define SYST_TOP 0xFFFFFFu

static volatile uint32_t systick_wraps;

void SysTick_Handler(void)
{
    systick_wraps++;
}

void mexc_io_count_start(void)
{
    SYST_CSR = 0u;
    SYST_RVR = SYST_TOP;
    SYST_CVR = 0u; /* any write clears it: the first tick reloads SYST_TOP */
    systick_wraps = 0u;
    SYST_CSR = 7u; /* the core clock, the wrap interrupt, enabled */
}

uint64_t mexc_io_count_read(void)
{
    uint32_t wraps, value;
    uint64_t ticks;
    do { /* a wrap between the two reads shows as a changed count: read again */
        wraps = systick_wraps;
        value = SYST_CVR;
    } while (wraps != systick_wraps);
    ticks = (uint64_t)wraps * (SYST_TOP + 1u) + (SYST_TOP - value);
    return ticks * 1000000000u / ((uint64_t)MEXC_SYSTICK_HZ << MEXC_ICOUNT_SHIFT);
}
#endif

/* GCC lowers struct copies and zeroing (`mexc_ctx_t fctx = ctx;`) to memcpy / memset calls even
 * under -ffreestanding -fno-builtin, most of all on ARMv6-M (Cortex-M0), and the image links
 * -nostdlib: a freestanding program must provide them (the C standard lets the compiler call
 * them). Byte loops, kept from being recognised as memcpy / memset themselves (and so turned
 * into calls to themselves) by no-tree-loop-distribute-patterns. The host build links libc's. */
#if defined(__GNUC__) && !defined(__clang__)
#define MEXC_NO_LIBCALL __attribute__((optimize("no-tree-loop-distribute-patterns"), used))
#else
#define MEXC_NO_LIBCALL __attribute__((used))
#endif

MEXC_NO_LIBCALL void *memcpy(void *restrict dst, const void *restrict src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

MEXC_NO_LIBCALL void *memmove(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s) {
        while (n--) *d++ = *s++;
    } else {
        d += n;
        s += n;
        while (n--) *--d = *--s;
    }
    return dst;
}

MEXC_NO_LIBCALL void *memset(void *dst, int c, size_t n)
{
    unsigned char *d = dst;
    while (n--) *d++ = (unsigned char)c;
    return dst;
}

void Reset_Handler(void)
{
    uint32_t *s, *d;
    for (s = &__data_load, d = &__data_start; d < &__data_end;) *d++ = *s++;
    for (d = &__bss_start; d < &__bss_end;) *d++ = 0;
    semihost_exit(main() == 0);
}

void Fault_Handler(void)
{
    mexc_io_puts("FAULT\n");
    semihost_exit(0);
}

__attribute__((section(".vectors"), used)) const void *const vectors[16] = {
    &__stack_top, Reset_Handler, Fault_Handler, Fault_Handler, Fault_Handler, Fault_Handler,
    Fault_Handler,
#if defined(MEXC_SYSTICK_HZ) && defined(MEXC_ICOUNT_SHIFT)
    [15] = SysTick_Handler,
#endif
};
