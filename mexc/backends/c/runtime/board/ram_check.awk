# Does the linked image fit its board's RAM, stack included? Run by the Makefile's `mcu` rule
# right after the link (docs/mcu.md, "Memory"); the rule deletes the image when this fails.
#
#   awk -v elf=IMAGE -v nm=arm-none-eabi-nm -v margin=BYTES -f ram_check.awk IMAGE-*.ci
#
# static RAM: __bss_end - __ram_start of the linker script (.data, then .bss, from the start of
#   RAM; the stack grows down from __stack_top, the end of RAM, towards them);
# stack: the heaviest call chain from Reset_Handler in GCC's -fcallgraph-info=su call graph (the
#   .ci files), the bound of mexc/backends/c/mcu_sizes.py: a function without a frame size
#   (libgcc's helpers) counts 32 bytes, a recursion or a frame that is not static is an error;
# interrupts: the heaviest chain from SysTick_Handler, plus `margin` bytes for the exception
#   frame the core pushes on entry (8 words, no FP context under -mfloat-abi=soft) and its
#   alignment padding.
# Prints one line `RAM: ...` and exits 0 when static + stack + interrupts + margin <= RAM;
# otherwise says by how much it is over and exits 1.

function fail(msg) {
    print elf ": " msg > "/dev/stderr"
    failed = 1
    exit 1
}

function hex(s,    i, v) {
    v = 0
    s = tolower(s)
    for (i = 1; i <= length(s); i++) v = v * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
    return v
}

function quoted(line, key,    rest) {  # the value of `key: "..."` on a .ci line
    rest = substr(line, index(line, key ": \"") + length(key) + 3)
    return substr(rest, 1, index(rest, "\"") - 1)
}

function bound(f,    kids, k, i, v, best) {  # the heaviest chain from f, f's frame included
    if (f in memo) return memo[f]
    if (f in open) fail("recursion through " f ": the MCU program needs a static stack bound")
    open[f] = 1
    best = 0
    k = split(calls[f], kids, " ")
    for (i = 1; i <= k; i++) {
        v = bound(kids[i])
        if (v > best) best = v
    }
    delete open[f]
    memo[f] = ((f in frame) ? frame[f] : 32) + best
    return memo[f]
}

BEGIN {
    cmd = nm " " elf
    read = 0
    while ((cmd | getline line) > 0) {
        read++
        n = split(line, w, " ")
        if (n == 3) sym[w[3]] = hex(w[1])
    }
    close(cmd)
    if (!read) fail("`" cmd "` printed nothing: is " nm " installed (make ARM_NM=...)?")
    if (!("__ram_start" in sym) || !("__stack_top" in sym) || !("__bss_end" in sym))
        fail("no __ram_start, __bss_end or __stack_top symbol: a linker script of runtime/board/?")
}

/^node: / {
    f = quoted($0, "title")
    node[f] = 1
    if (match($0, /\\n[0-9]+ bytes \([^)]*\)"/)) {
        split(substr($0, RSTART + 2, RLENGTH - 3), w, " ")
        if (w[3] != "(static)") fail(f " has a " w[3] " stack frame; the MCU program needs static frames")
        if (!(f in frame) || w[1] + 0 > frame[f]) frame[f] = w[1] + 0
    }
}

/^edge: / {
    calls[quoted($0, "sourcename")] = calls[quoted($0, "sourcename")] " " quoted($0, "targetname")
}

END {
    if (failed) exit 1
    if (!("Reset_Handler" in node)) fail("no call graph entry for Reset_Handler (-fcallgraph-info=su?)")
    ram = sym["__stack_top"] - sym["__ram_start"]
    used = sym["__bss_end"] - sym["__ram_start"]
    stack = bound("Reset_Handler")
    irq = ("SysTick_Handler" in node) ? bound("SysTick_Handler") : 0
    need = used + stack + irq + margin
    line = sprintf("RAM: %d B of %d: .data+.bss %d, stack bound %d, interrupts %d + %d", \
                   need, ram, used, stack, irq, margin)
    if (need > ram) {
        print elf ": does not fit the board's RAM, " need - ram " B over. " line > "/dev/stderr"
        print elf ": Lower the batch size, train fewer parameters (--trainable), use a smaller " \
              "model or a board with more RAM (docs/mcu.md, \"Memory\")." > "/dev/stderr"
        exit 1
    }
    printf "%s (%d B free)\n", line, ram - need
}
