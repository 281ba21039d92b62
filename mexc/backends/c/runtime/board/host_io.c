/* Host build: output to stdout through write(2). */
#include <string.h>
#include <unistd.h>

void mexc_io_puts(const char *s)
{
    ssize_t r = write(1, s, strlen(s));
    (void)r;
}
