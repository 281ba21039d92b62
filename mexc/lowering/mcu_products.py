"""The product kernels of the C backend (conv incl. grouped and depthwise, linear, and their
gradients) as TVM tensor expressions with a schedule for a small in-order core.

A product with compaction never stores its int32 accumulator (docs/mcu.md): it is two kernels
over the same TIR accumulation, `scan` (max |v| over every output element) and `round` (each
element again, rounded with the shift that the scan's maximum gives), where v is the
accumulator or, with a bias, the aligned sum of accumulator and bias. The accumulator of one
output element lives in a one-element scratch (`compute_at` into the output loop), so the
kernels need no buffer beyond their operands. The weight gradient is the int32 gradient the
update consumes, so it is written whole.

The rounding primitives are the C runtime's (`mexc_shift_right`, `mexc_shift_signed`,
`mexc_saturate`: docs/numerics.md section 4, one definition for every C kernel), called from
TIR as extern functions; the exponent bookkeeping around the kernels (operand pre-shift, aligned
target, compaction shift) is the runtime's `mexc_product_begin` / `mexc_product_end`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm import s_tir, te, tirx
from tvm.script import tirx as T

from mexc.lowering import tvmscript_stack
from mexc.lowering.te_func import prim_func
from mexc.lowering.te_products import (
    ConvGeom,
    _guarded,
    _in,
    _mul,
    _tap,
    axis_tap,
    conv_forward_sum,
    conv_grad_input_sum,
    conv_grad_weight_sum,
    has_block,
)

I8, I32, U32 = "int8", "int32", "uint32"
Expr = Any  # a TIR expression (tvm.tirx has no public PrimExpr type to name at run time)
# taps of a kernel window up to this many are unrolled: the bounds tests fold per tap
UNROLL_TAPS = 9
# the dot form's column of one output position lives on the stack: at most this many bytes
MAX_COLUMN = 1024
DOT4 = "mexc_dot4_acc"  # the tensor intrinsic: c += a[0:4] . b[0:4], as runtime's mexc_dot4


# the @T.prim_func below run at import: TVMScript's stack walk made cheap first
tvmscript_stack.install()


@T.prim_func(s_tir=True)
def _dot4_desc(
    a: T.Buffer((4,), "int8", offset_factor=1, align=1),  # type: ignore[valid-type]
    b: T.Buffer((4,), "int8", offset_factor=1, align=1),  # type: ignore[valid-type]
    c: T.Buffer((1,), "int32", offset_factor=1, align=1),  # type: ignore[valid-type]
) -> None:
    with T.sblock("root"):
        T.reads(c[0], a[0:4], b[0:4])
        T.writes(c[0])
        for i in range(4):
            with T.sblock("update"):
                vi = T.axis.remap("R", [i])
                c[0] = c[0] + T.cast(a[vi], "int32") * T.cast(b[vi], "int32")


@T.prim_func(s_tir=True)
def _dot4_impl(
    a: T.Buffer((4,), "int8", offset_factor=1, align=1),  # type: ignore[valid-type]
    b: T.Buffer((4,), "int8", offset_factor=1, align=1),  # type: ignore[valid-type]
    c: T.Buffer((1,), "int32", offset_factor=1, align=1),  # type: ignore[valid-type]
) -> None:
    with T.sblock("root"):
        T.reads(c[0], a[0:4], b[0:4])
        T.writes(c[0])
        # two SMLAD dual 16-bit MACs on a core with the DSP extension (runtime/mexc_simd.h)
        c[0] = T.call_extern("int32", "mexc_dot4", a.access_ptr("r"), b.access_ptr("r"), c[0])


def _register_dot4() -> None:
    try:
        s_tir.TensorIntrin.get(DOT4)
    except Exception:  # noqa: BLE001 - TVM raises its own error type when absent
        s_tir.TensorIntrin.register(DOT4, _dot4_desc, _dot4_impl)


@dataclass(frozen=True)
class Scalars:
    """The scalar parameters of a kernel, in ABI order after its operand pointers."""

    names: tuple[str, ...]

    def vars(self) -> dict[str, tirx.Var]:
        return {n: tirx.Var(n, U32 if n.startswith("k") else I32) for n in self.names}


BIAS_SCALARS = Scalars(("ta", "tb", "stoch", "k1", "k2"))  # the aligned sum with the bias
ROUND_SCALARS = Scalars(("s", "stoch", "k0", "bits"))  # the compaction's rounding
# `stoch` (the context's rounding mode) is one variable where a kernel has both sets


def _flat(shape: tuple[int, ...], idx: tuple[Expr, ...]) -> Expr:
    """C-order flat index as uint32: the PRNG counter of an element (numerics section 3)."""
    flat: Expr = tirx.const(0, I32)
    for extent, i in zip(shape, idx):
        flat = flat * extent + i
    return flat.astype(U32)


def _call(dtype: str, name: str, *args: Expr) -> Expr:
    return tirx.call_extern(dtype, name, *args)


Value = Callable[..., Expr]  # value(*output index) -> int32, reading the accumulator


def _scan_and_round(
    name: str,
    shape: tuple[int, ...],
    inputs: list[te.Tensor],
    scalars: dict[str, tirx.Var],
    value: Value,
    schedule: Callable[[tirx.PrimFunc, str], tirx.PrimFunc],
    channels: bool = False,
) -> dict[str, tirx.PrimFunc]:
    """`{name}_scan` (inputs, scalars, amax[1]) and `{name}_round` (inputs, scalars, s, stoch,
    k0, bits, out): the compaction of value over `shape` without storing it. schedule(func,
    consumer block) places the accumulation inside the consumer's loops. `channels`: the
    channel-exponent pair instead (_channel_scan_and_round)."""
    if channels:
        return _channel_scan_and_round(name, shape, inputs, scalars, value, schedule)
    axes = [te.reduce_axis((0, d), f"r{i}") for i, d in enumerate(shape)]

    def magnitude(*idx: Expr) -> Expr:
        v = tirx.Var("v", I32)  # bound once: the value may call the runtime's shifts
        return tirx.Let(v, value(*idx), tirx.max(v, -v))  # above -2^31: numerics section 6

    amax = te.compute((1,), lambda _: te.max(magnitude(*axes), axis=axes), name="amax")
    scan = prim_func([*inputs, *scalars.values(), amax], f"{name}_scan")
    r = {**ROUND_SCALARS.vars(), **{k: v for k, v in scalars.items() if k == "stoch"}}

    def rounded(*idx: Expr) -> Expr:
        shifted = _call(
            I32, "mexc_shift_right", value(*idx), r["s"], r["stoch"], r["k0"], _flat(shape, idx)
        )
        return _call(I8, "mexc_saturate", shifted, r["bits"])

    out = te.compute(shape, rounded, name="out")
    rest = [r[n] for n in ROUND_SCALARS.names if n not in scalars]
    rnd = prim_func([*inputs, *scalars.values(), *rest, out], f"{name}_round")
    return {
        f"{name}_scan": schedule(scan, "amax"),
        f"{name}_round": schedule(rnd, "out"),
    }


def _channel_scan_and_round(
    name: str,
    shape: tuple[int, ...],
    inputs: list[te.Tensor],
    scalars: dict[str, tirx.Var],
    value: Value,
    schedule: Callable[[tirx.PrimFunc, str], tirx.PrimFunc],
) -> dict[str, tirx.PrimFunc]:
    """Channel exponents (docs/numerics.md section 5) along axis 1 of `shape`: `{name}_cscan`
    (inputs, scalars, word[C], out) notes max |value| per channel in word (the runtime's
    mexc_chan_note; it stores 0 into out, which the round overwrites: no buffer of its own),
    and `{name}_cround` (inputs, scalars, word[C], stoch, k0, bits, out) rounds each element
    with its channel's shifts, which mexc_product_end_channels packed into word
    (mexc_frame_round). Both keep the output-shaped loop nest of the plain round, so that its
    schedule applies to them as it is."""
    c = shape[1]
    word = te.placeholder((c,), U32, name="word")

    def note(*idx: Expr) -> Expr:
        slot = tirx.call_intrin("handle", "tirx.address_of", word(idx[1]))
        return _call(I8, "mexc_chan_note", slot, value(*idx))

    scan_out = te.compute(shape, note, name="out")
    scan = prim_func([*inputs, *scalars.values(), word, scan_out], f"{name}_cscan")
    r = {**ROUND_SCALARS.vars(), **{k: v for k, v in scalars.items() if k == "stoch"}}

    def rounded(*idx: Expr) -> Expr:
        args = (word[idx[1]], r["bits"], r["stoch"], r["k0"], _flat(shape, idx))
        return _call(I8, "mexc_frame_round", value(*idx), *args)

    out = te.compute(shape, rounded, name="out")
    rest = [r[n] for n in ROUND_SCALARS.names if n not in scalars and n != "s"]
    rnd = prim_func([*inputs, *scalars.values(), word, *rest, out], f"{name}_cround")
    return {f"{name}_cscan": schedule(scan, "out"), f"{name}_cround": schedule(rnd, "out")}


def _dot_form(g: ConvGeom) -> bool:
    """Whether the forward product takes the dot form: a column of the input window per output
    position, reused by the group's output channels (or the input row itself for a linear
    layer), and 4-element dot products against each weight row."""
    k = g.cg * g.kh * g.kw
    direct = g.h == g.w == g.kh == g.kw == 1
    return k >= 4 and (direct or (g.og >= 2 and k <= MAX_COLUMN))


def _forward_accumulation(
    g: ConvGeom,
) -> tuple[list[te.Tensor], list[te.Tensor], Callable[[tirx.PrimFunc, str], tirx.PrimFunc]]:
    """(operands x and w, the partial sums whose total is the accumulator, their schedule)."""
    if not _dot_form(g):
        x = te.placeholder(g.x_shape, I8, name="x")
        w = te.placeholder(g.w_shape, I8, name="w")
        acc = conv_forward_sum(g, x, w)
        return [x, w], [acc], lambda f, use: _schedule(f, use, g.kh * g.kw, g.cg == 1)
    taps, k = g.kh * g.kw, g.cg * g.kh * g.kw
    direct = g.h == g.w == g.kh == g.kw == 1
    # a linear layer reads its rows in place: (N, K) and (O, K), 2-D so that the intrinsic
    # matches a contiguous last axis
    x = te.placeholder((g.n, g.c) if direct else g.x_shape, I8, name="x")
    w = te.placeholder((g.o, k), I8, name="w")
    if direct:

        def source(n: Expr, grp: Expr, y: Expr, xx: Expr, r: Expr) -> Expr:
            return x[n, grp * g.cg + r]

    else:

        def window(n: Expr, grp: Expr, oy: Expr, ox: Expr, r: Expr) -> Expr:
            c, i, j = r // taps, r % taps // g.kw, r % g.kw
            iy, ix = oy * g.sh + i - g.ph, ox * g.sw + j - g.pw
            ok = tirx.all(_in(0, iy, g.h), _in(0, ix, g.w))
            return tirx.if_then_else(ok, x[n, grp * g.cg + c, iy, ix], tirx.const(0, I8))

        col = te.compute((g.n, g.groups, g.oh, g.ow, k), window, name="col")

        def source(n: Expr, grp: Expr, y: Expr, xx: Expr, r: Expr) -> Expr:
            return col[n, grp, y, xx, r]

    k4 = k // 4 * 4
    parts = []
    for lo, hi, part in ((0, k4, "acc"), (k4, k, "acc_rest")):
        if hi > lo:
            rk = te.reduce_axis((lo, hi), f"{part}_k")

            def body(n: Expr, o: Expr, y: Expr, xx: Expr, rk: Any = rk) -> Expr:
                return te.sum(_mul(source(n, o // g.og, y, xx, rk), w[o, rk]), axis=rk)

            parts.append(te.compute(g.y_shape, _no_defaults(body), name=part))
    split = None if direct else [g.cg, g.kh, g.kw]
    return [x, w], parts, lambda f, use: _schedule_dot(f, use, g, g.og, split)


def _no_defaults(body: Callable[..., Expr]) -> Callable[..., Expr]:
    """te.compute rejects a function with default arguments (the loop's bound reduce axis)."""
    return lambda n, o, y, xx: body(n, o, y, xx)


def _four(body: Callable[..., Expr]) -> Callable[..., Expr]:
    """_no_defaults for four axes of any names."""
    return lambda a, b, c, d: body(a, b, c, d)


def _five(body: Callable[..., Expr]) -> Callable[..., Expr]:
    """_no_defaults for five axes."""
    return lambda n, o, c, i, j: body(n, o, c, i, j)


def conv_forward(
    name: str, g: ConvGeom, bias: bool, channels: bool = False
) -> dict[str, tirx.PrimFunc]:
    """Scan and round of a convolution (a linear layer: a 1x1 convolution on (N, K, 1, 1)),
    with its bias added as docs/numerics.md section 7's aligned sum when `bias`. Operands
    (x, w[, b]); with a bias, scalars ta = t - e_acc, tb = t - e_b, stoch, k1, k2."""
    operands, parts, schedule = _forward_accumulation(g)
    acc = _total(parts)

    if not bias:
        return _scan_and_round(name, g.y_shape, operands, {}, acc, schedule, channels)
    b = te.placeholder((g.o,), I8, name="b")
    sv = BIAS_SCALARS.vars()

    def aligned(*idx: Expr) -> Expr:
        flat = _flat(g.y_shape, idx)
        a = _call(I32, "mexc_shift_signed", acc(*idx), sv["ta"], sv["stoch"], sv["k1"], flat)
        o = idx[1]
        bo = b[o].astype(I32)
        return a + _call(
            I32, "mexc_shift_signed", bo, sv["tb"], sv["stoch"], sv["k2"], o.astype(U32)
        )

    return _scan_and_round(name, g.y_shape, [*operands, b], sv, aligned, schedule, channels)


def _dot_grad_input(g: ConvGeom) -> bool:
    """Whether the input gradient takes the dot form: a column of dy per input position (the
    group's output channels times the kernel taps), reused by the group's input channels, and
    each weight's taps (contiguous) four at a time."""
    taps = g.kh * g.kw
    return taps >= 4 and g.cg >= 2 and g.og * taps <= MAX_COLUMN


def conv_grad_input(name: str, g: ConvGeom, channels: bool = False) -> dict[str, tirx.PrimFunc]:
    """Scan and round of the input gradient. Operands (dy, w)."""
    if _dot_grad_input(g):
        return _grad_input_dot(name, g, channels)
    dy = te.placeholder(g.y_shape, I8, name="dy")
    w = te.placeholder(g.w_shape, I8, name="w")
    acc = conv_grad_input_sum(g, dy, w)

    def schedule(f: tirx.PrimFunc, use: str) -> tirx.PrimFunc:
        return _schedule(f, use, g.kh * g.kw, g.og == 1)

    return _scan_and_round(name, g.x_shape, [dy, w], {}, lambda *i: acc[i], schedule, channels)


def _grad_input_dot(name: str, g: ConvGeom, channels: bool) -> dict[str, tirx.PrimFunc]:
    """The input gradient's dot form: dy's window of each input position gathered once."""
    taps = g.kh * g.kw
    dy = te.placeholder(g.y_shape, I8, name="dy")
    w = te.placeholder((g.o, g.cg, taps), I8, name="w")  # the taps of one weight: a last axis

    def window(n: Expr, grp: Expr, y: Expr, xx: Expr, ol: Expr, t: Expr) -> Expr:
        ty, oky = axis_tap(y, t // g.kw, g.sh, g.ph, g.oh)
        tx, okx = axis_tap(xx, t % g.kw, g.sw, g.pw, g.ow)
        value = dy[n, grp * g.og + ol, ty, tx]
        return tirx.if_then_else(tirx.all(oky, okx), value, tirx.const(0, I8))

    col = te.compute((g.n, g.groups, g.h, g.w, g.og, taps), window, name="col")
    t4 = taps // 4 * 4
    parts = []
    for lo, hi, part in ((0, t4, "acc"), (t4, taps, "acc_rest")):
        if hi > lo:
            ro = te.reduce_axis((0, g.og), f"{part}_o")
            rt = te.reduce_axis((lo, hi), f"{part}_t")

            def body(n: Expr, c: Expr, y: Expr, xx: Expr, ro: Any = ro, rt: Any = rt) -> Expr:
                grp = c // g.cg
                v = _mul(col[n, grp, y, xx, ro, rt], w[grp * g.og + ro, c % g.cg, rt])
                return te.sum(v, axis=[ro, rt])

            parts.append(te.compute(g.x_shape, _no_defaults(body), name=part))

    def schedule(f: tirx.PrimFunc, use: str) -> tirx.PrimFunc:
        return _schedule_dot(f, use, g, g.cg, [g.kh, g.kw])

    return _scan_and_round(name, g.x_shape, [dy, w], {}, _total(parts), schedule, channels)


def _total(parts: list[te.Tensor]) -> Value:
    """The accumulator as the sum of its parts (the dot form's quads and its rest)."""

    def acc(*idx: Expr) -> Expr:
        total = parts[0][idx]
        for p in parts[1:]:
            total = total + p[idx]
        return total

    return acc


def linear_grad_weight_row(name: str, n: int, k: int, o: int) -> tirx.PrimFunc:
    """One row of a linear layer's int32 weight gradient, `{name}` (dy, x, row, dw_row):
    dw_row[k] = sum_n dy[n, row] * x[n, k]. The C backend streams the update of a row-grouped
    weight through it (docs/mcu.md): a row at a time instead of the whole int32 gradient."""
    dy = te.placeholder((n, o), I8, name="dy")
    x = te.placeholder((n, k), I8, name="x")
    row = tirx.Var("row", I32)
    rn = te.reduce_axis((0, n), "rn")
    dw = te.compute((k,), lambda j: te.sum(_mul(dy[rn, row], x[rn, j]), axis=rn), name="acc")
    sch = s_tir.Schedule(prim_func([dy, x, row, dw], name))
    blk = sch.get_sblock("acc")
    loops = sch.get_loops(blk)
    scratch = sch.cache_write(blk, 0, "global")  # one element: TVM's C codegen rejects `local`
    sch.reverse_compute_at(scratch, loops[0])
    if len(loops) > 1:  # no reduction loop is left for one sample
        sch.decompose_reduction(blk, loops[1])
    return sch.mod["main"]


def conv_grad_weight_row(name: str, g: ConvGeom) -> tirx.PrimFunc:
    """One output channel's int32 weight gradient of a convolution, `{name}` (dy, x, row,
    dw_row): dw_row[c', i, j] = dw[row, c', i, j] (conv_grad_weight_acc's formula). The C
    backend streams a convolution's update through it where that lowers the step's RAM."""
    if _padded_row_form(g):
        return _grad_weight_row_padded(name, g)
    dy = te.placeholder(g.y_shape, I8, name="dy")
    x = te.placeholder(g.x_shape, I8, name="x")
    row = tirx.Var("row", I32)
    rn = te.reduce_axis((0, g.n), "rn")
    ry = te.reduce_axis((0, g.oh), "ry")
    rx = te.reduce_axis((0, g.ow), "rx")

    def body(cw: Expr, i: Expr, j: Expr) -> Expr:
        iy, ix, ok = _tap(g, ry, rx, i, j)
        c = (row // g.og) * g.cg + cw if g.groups > 1 else cw
        v = _mul(dy[rn, row, ry, rx], x[rn, c, iy, ix])
        return te.sum(_guarded(ok, v), axis=[rn, ry, rx])

    dw = te.compute((g.cg, g.kh, g.kw), body, name="acc")
    sch = s_tir.Schedule(prim_func([dy, x, row, dw], name))
    blk = sch.get_sblock("acc")
    loops = sch.get_loops(blk)
    scratch = sch.cache_write(blk, 0, "global")  # one element: TVM's C codegen rejects `local`
    sch.reverse_compute_at(scratch, loops[2])
    if len(loops) > 3:  # no reduction loop is left when N, OH and OW are all one
        sch.decompose_reduction(blk, loops[3])
    return sch.mod["main"]


def _padded_row_form(g: ConvGeom) -> bool:
    """Whether one output channel's weight gradient takes the padded form: stride 1, one
    group, the row's dy plane with its zero border on the stack (at most MAX_COLUMN bytes),
    input rows of at least 4."""
    padded = (g.h + g.kh - 1) * (g.w + g.kw - 1)
    return g.sh == g.sw == 1 and g.groups == 1 and g.w >= 4 and padded <= MAX_COLUMN


def _grad_weight_row_padded(name: str, g: ConvGeom) -> tirx.PrimFunc:
    """dw_row[c', i, j] = sum over n, y, x of x[n, c', y, x] * dyp[n, y + KH-1-i, x + KW-1-j],
    dyp the row's dy plane of each sample placed in a zero border (dy[n, row, y + ph - i,
    x + pw - j] where that exists, else 0; stride 1). Per sample the border plane is built once
    for every input channel and tap; each input row then meets a contiguous row of it, four
    terms at a time through DOT4; the sum over a sample's positions stays in a register and the
    samples add up in dw_row."""
    _register_dot4()
    dy = te.placeholder(g.y_shape, I8, name="dy")
    x = te.placeholder(g.x_shape, I8, name="x")
    row = tirx.Var("row", I32)
    hp, wp = g.h + g.kh - 1, g.w + g.kw - 1

    def bordered(n: Expr, a: Expr, b: Expr) -> Expr:
        oy, ox = a - (g.kh - 1) + g.ph, b - (g.kw - 1) + g.pw
        ok = tirx.all(_in(0, oy, g.oh), _in(0, ox, g.ow))
        return tirx.if_then_else(ok, dy[n, row, oy, ox], tirx.const(0, I8))

    dyp = te.compute((g.n, hp, wp), bordered, name="col")
    w4 = g.w // 4 * 4
    parts = []
    for lo, hi, part in ((0, w4, "part"), (w4, g.w, "part_rest")):
        if hi > lo:
            ry = te.reduce_axis((0, g.h), f"{part}_y")
            rx = te.reduce_axis((lo, hi), f"{part}_x")

            def body(n: Expr, cw: Expr, i: Expr, j: Expr, ry: Any = ry, rx: Any = rx) -> Expr:
                a, b = ry + (g.kh - 1) - i, rx + (g.kw - 1) - j
                return te.sum(_mul(x[n, cw, ry, rx], dyp[n, a, b]), axis=[ry, rx])

            parts.append(te.compute((g.n, g.cg, g.kh, g.kw), _four(body), name=part))
    rn = te.reduce_axis((0, g.n), "rn")

    def total(cw: Expr, i: Expr, j: Expr) -> Expr:
        v = parts[0][rn, cw, i, j]
        for p in parts[1:]:
            v = v + p[rn, cw, i, j]
        return te.sum(v, axis=rn)

    dw = te.compute((g.cg, g.kh, g.kw), total, name="acc")
    sch = s_tir.Schedule(prim_func([dy, x, row, dw], name))
    blk = sch.get_sblock("acc")
    # the sample loop: TVM keeps it for one sample too (extent 1), but do not count on it
    cw, i, j, *rest = sch.get_loops(blk)
    n = rest[0] if rest else None
    if n is not None:
        sch.reorder(n, cw, i, j)
        sch.decompose_reduction(blk, n)
    quads = None
    for part in ("part", "part_rest"):
        if not has_block(sch, part):
            continue
        pb = sch.get_sblock(part)
        sch.compute_at(pb, j)
        if part == "part":
            sch.split(sch.get_loops(pb)[-1], [None, 4])
            quads = sch.get_loops(pb)[-1]
        # its own loops, below j (where the row loop of one input plane was not dropped)
        own = sch.get_loops(pb)[_depth(sch, pb, j) :]
        if own:
            sch.decompose_reduction(pb, own[0])
    sch.compute_at(sch.get_sblock("col"), n if n is not None else cw)
    if quads is not None:
        sch.tensorize(quads, DOT4)
    return sch.mod["main"]


def _depth(sch: s_tir.Schedule, blk: Any, loop: Any) -> int:
    """How many of `blk`'s loops enclose it down to `loop` included."""
    target = sch.get(loop)
    for k, lp in enumerate(sch.get_loops(blk)):
        if sch.get(lp).same_as(target):
            return k + 1
    raise ValueError("the loop does not enclose the block")


def _dot_grad_weight(g: ConvGeom) -> bool:
    """Whether the weight gradient takes the dot form: per sample, input channel and tap, the
    input plane shifted by the tap (OH*OW bytes, zero outside), reused by every output channel,
    and four output positions at a time against dy's plane. One group only (a column per
    group channel would not be reused)."""
    s = g.oh * g.ow
    return g.groups == 1 and 4 <= s <= MAX_COLUMN and g.kh * g.kw > 1


def conv_grad_weight(name: str, g: ConvGeom) -> dict[str, tirx.PrimFunc]:
    """The int32 weight gradient `{name}` (dy, x, dw)."""
    if _dot_grad_weight(g):
        return {name: _grad_weight_dot(name, g)}
    dy = te.placeholder(g.y_shape, I8, name="dy")
    x = te.placeholder(g.x_shape, I8, name="x")
    acc = conv_grad_weight_sum(g, dy, x)
    func = prim_func([dy, x, acc], name)
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("acc")
    loops = sch.get_loops(blk)
    scratch = sch.cache_write(blk, 0, "global")  # one element: TVM's C codegen rejects `local`
    sch.reverse_compute_at(scratch, loops[3])
    if len(loops) > 4:  # no reduction loop is left when N, OH and OW are all one
        sch.decompose_reduction(blk, loops[4])
    return {name: sch.mod["main"]}


def _schedule(func: tirx.PrimFunc, consumer: str, taps: int, unit_first: bool) -> tirx.PrimFunc:
    """The accumulator of each output element in a one-element scratch inside the consumer's
    loop nest (scan: `amax`, round: `out`), its reduction initialised there, and a small kernel
    window unrolled (its bounds tests then fold per tap). TVM drops reduction loops of extent 1:
    unit_first says the first reduction axis (channels) is one."""
    sch = s_tir.Schedule(func)
    acc = sch.get_sblock("acc")
    use = sch.get_sblock(consumer)
    sch.compute_at(acc, sch.get_loops(use)[-1])
    n_out = len(sch.get_loops(use))
    loops = sch.get_loops(acc)
    if len(loops) > n_out:
        sch.decompose_reduction(acc, loops[n_out])
    if taps <= UNROLL_TAPS:
        for loop in sch.get_loops(acc)[n_out + (0 if unit_first else 1) :]:
            sch.unroll(loop)
    if consumer == "amax":
        sch.decompose_reduction(use, sch.get_loops(use)[0])
    return sch.mod["main"]


def _schedule_dot(
    func: tirx.PrimFunc, consumer: str, g: ConvGeom, per_group: int, col_split: list[int] | None
) -> tirx.PrimFunc:
    """The dot form: output positions outermost and the group's output channels (per_group of
    them) inside them, the column of the window gathered once per position (`col`, a stack
    array; its last loop split into col_split, so that its indices need no division), the
    accumulator of each output in a one-element scratch, the last reduction loop of `acc` four
    terms at a time through DOT4 and `acc_rest` one by one."""
    _register_dot4()
    sch = s_tir.Schedule(func)
    use = sch.get_sblock(consumer)
    n, ch, y, xx = sch.get_loops(use)[-4:]
    if g.groups > 1:
        grp, inner = sch.split(ch, [g.groups, per_group])
        sch.reorder(n, grp, y, xx, inner)
    else:
        sch.reorder(n, y, xx, ch)
        inner = ch
    n_out = len(sch.get_loops(use))
    quads = None
    for part in ("acc", "acc_rest"):
        if not has_block(sch, part):
            continue
        blk = sch.get_sblock(part)
        sch.compute_at(blk, inner)
        if part == "acc":
            _, quads = sch.split(sch.get_loops(blk)[-1], [None, 4])
        loops = sch.get_loops(blk)
        if len(loops) > n_out:  # a rest of one term has no loop
            sch.decompose_reduction(blk, loops[n_out])
    if col_split is not None:
        col = sch.get_sblock("col")
        sch.compute_at(col, xx)
        sch.split(sch.get_loops(col)[-1], col_split)
    if consumer == "amax":
        sch.decompose_reduction(use, sch.get_loops(use)[0])
    if quads is not None:
        sch.tensorize(quads, DOT4)
    return sch.mod["main"]


def _grad_weight_dot(name: str, g: ConvGeom) -> tirx.PrimFunc:
    """dw[o,c,i,j] = sum over n of part[n,o,c,i,j], part = dy[n,o,:] . shifted[n,c,i,j,:]: the
    sum over positions in a one-element scratch per (n, o), the sum over n in dw itself."""
    _register_dot4()
    s = g.oh * g.ow
    dy = te.placeholder((g.n, g.o, s), I8, name="dy")  # one plane: a contiguous last axis
    x = te.placeholder(g.x_shape, I8, name="x")

    def shifted(n: Expr, c: Expr, i: Expr, j: Expr, r: Expr) -> Expr:
        iy, ix = (r // g.ow) * g.sh + i - g.ph, (r % g.ow) * g.sw + j - g.pw
        ok = tirx.all(_in(0, iy, g.h), _in(0, ix, g.w))
        return tirx.if_then_else(ok, x[n, c, iy, ix], tirx.const(0, I8))

    col = te.compute((g.n, g.c, g.kh, g.kw, s), shifted, name="col")
    s4 = s // 4 * 4
    parts = []
    for lo, hi, part in ((0, s4, "part"), (s4, s, "part_rest")):
        if hi > lo:
            rr = te.reduce_axis((lo, hi), f"{part}_r")

            def body(n: Expr, o: Expr, c: Expr, i: Expr, j: Expr, rr: Any = rr) -> Expr:
                return te.sum(_mul(dy[n, o, rr], col[n, c, i, j, rr]), axis=rr)

            parts.append(te.compute((g.n, g.o, g.c, g.kh, g.kw), _five(body), name=part))
    rn = te.reduce_axis((0, g.n), "rn")

    def total(o: Expr, c: Expr, i: Expr, j: Expr) -> Expr:
        v = parts[0][rn, o, c, i, j]
        for p in parts[1:]:
            v = v + p[rn, o, c, i, j]
        return te.sum(v, axis=rn)

    dw = te.compute(g.w_shape, total, name="acc")
    sch = s_tir.Schedule(prim_func([dy, x, dw], name))
    blk = sch.get_sblock("acc")
    # the sample loop: TVM keeps it for one sample too (extent 1), but do not count on it
    o, c, i, j, *rest = sch.get_loops(blk)
    n = rest[0] if rest else None
    if n is not None:
        sch.reorder(c, i, j, n, o)
        sch.decompose_reduction(blk, n)
    else:
        sch.reorder(c, i, j, o)
    quads = None
    for part in ("part", "part_rest"):
        if not has_block(sch, part):
            continue
        pb = sch.get_sblock(part)
        sch.compute_at(pb, o)
        if part == "part":
            sch.split(sch.get_loops(pb)[-1], [None, 4])
            quads = sch.get_loops(pb)[-1]
        own = sch.get_loops(pb)[_depth(sch, pb, o) :]  # none for a rest of one term
        if own:
            sch.decompose_reduction(pb, own[0])
    cb = sch.get_sblock("col")
    sch.compute_at(cb, n if n is not None else j)
    sch.split(sch.get_loops(cb)[-1], [g.oh, g.ow])
    if quads is not None:
        sch.tensorize(quads, DOT4)
    return sch.mod["main"]
