/* Cortex-M startup for QEMU's mps2-an385: vector table, .data/.bss setup, ARM semihosting for
 * output and exit (bkpt 0xAB). No libc. */
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
};
