/* mexc training driver: trains MEXC_STEPS steps over the embedded data in order (step k uses
 * batch k mod MEXC_DATA_BATCHES, i.e. samples k*B .. k*B+B-1 wrapping around), printing
 * "step K loss L" (L in thousandths; on a board that counts instructions, MEXC_SYSTICK_HZ set,
 * "step K loss L insns N": the step's instructions) and finally "STATE <16 hex digits>", the
 * state checksum of docs/numerics.md. Integer only; output goes through mexc_io_puts
 * (semihosting or stdout). */
#include "mexc_rt.h"
#include "model.h"
#include "data.h"

void mexc_io_puts(const char *s);
#if defined(MEXC_SYSTICK_HZ) && defined(MEXC_ICOUNT_SHIFT)
#define MEXC_COUNTS_INSNS 1
void mexc_io_count_start(void);
uint64_t mexc_io_count_read(void);
#endif

static void put_dec(uint32_t v, uint32_t width)
{
    /* decimal without division: subtract powers of ten; at least `width` digits */
    static const uint32_t pow10[10] = {1000000000u, 100000000u, 10000000u, 1000000u, 100000u,
                                       10000u, 1000u, 100u, 10u, 1u};
    char buf[11];
    uint32_t i, n = 0;
    for (i = 0; i < 10u; i++) {
        char d = '0';
        while (v >= pow10[i]) {
            v -= pow10[i];
            d++;
        }
        if (d != '0' || n > 0u || i == 9u || 10u - i <= width) buf[n++] = d;
    }
    buf[n] = 0;
    mexc_io_puts(buf);
}

static void put_u32(uint32_t v)
{
    put_dec(v, 1u);
}

#ifdef MEXC_COUNTS_INSNS
static void put_u64(uint64_t v)
{
    /* in base 10^9 pieces (a step's count can pass 2^32), without a 64-bit division */
    uint32_t high = 0;
    while (v >= 1000000000u) {
        v -= 1000000000u;
        high++;
    }
    if (high > 0u) {
        put_u32(high);
        put_dec((uint32_t)v, 9u);
    } else {
        put_u32((uint32_t)v);
    }
}
#endif

static void put_loss(int32_t milli)
{
    uint32_t u = milli < 0 ? (uint32_t)(-milli) : (uint32_t)milli;
    uint32_t whole = 0;
    char frac[5] = {'.', '0', '0', '0', 0};
    if (milli < 0) mexc_io_puts("-");
    while (u >= 1000u) {
        u -= 1000u;
        whole++;
    }
    put_u32(whole);
    while (u >= 100u) { u -= 100u; frac[1]++; }
    while (u >= 10u) { u -= 10u; frac[2]++; }
    frac[3] = (char)('0' + u);
    mexc_io_puts(frac);
}

int main(void)
{
    uint32_t k, b = 0;
    char hex[17];
    mexc_model_init();
    for (k = 0; k < MEXC_STEPS; k++) {
        int32_t loss;
#ifdef MEXC_COUNTS_INSNS
        uint64_t insns;
        mexc_io_count_start();
#endif
        loss = mexc_model_step(MEXC_START_STEP + k, mexc_data_x[b], mexc_data_xe[b],
                               mexc_data_y[b]);
#ifdef MEXC_COUNTS_INSNS
        insns = mexc_io_count_read();
#endif
        mexc_io_puts("step ");
        put_u32(MEXC_START_STEP + k);
        mexc_io_puts(" loss ");
        put_loss(loss);
#ifdef MEXC_COUNTS_INSNS
        mexc_io_puts(" insns ");
        put_u64(insns);
#endif
        mexc_io_puts("\n");
        if (++b == MEXC_DATA_BATCHES) b = 0;
    }
    mexc_hex64(mexc_model_checksum(), hex);
    mexc_io_puts("STATE ");
    mexc_io_puts(hex);
    mexc_io_puts("\n");
    return 0;
}
