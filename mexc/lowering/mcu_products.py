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

from mexc.lowering.te_func import prim_func
from mexc.lowering.te_products import ConvGeom, _guarded, _in, _mul, _tap

I8, I32, U32 = "int8", "int32", "uint32"
Expr = Any  # a TIR expression (tvm.tirx has no public PrimExpr type to name at run time)
# taps of a kernel window up to this many are unrolled: the bounds tests fold per tap
UNROLL_TAPS = 9


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


def conv_acc(g: ConvGeom, x: te.Tensor, w: te.Tensor) -> te.Tensor:
    """acc[n,o,y,x] of the forward convolution (te_products.conv2d_acc's formula)."""
    rc = te.reduce_axis((0, g.cg), "rc")
    ri = te.reduce_axis((0, g.kh), "ri")
    rj = te.reduce_axis((0, g.kw), "rj")

    def body(n: Expr, o: Expr, y: Expr, xx: Expr) -> Expr:
        iy, ix, ok = _tap(g, y, xx, ri, rj)
        c = (o // g.og) * g.cg + rc if g.groups > 1 else rc
        return te.sum(_guarded(ok, _mul(x[n, c, iy, ix], w[o, rc, ri, rj])), axis=[rc, ri, rj])

    return te.compute(g.y_shape, body, name="acc")


def conv_grad_input_acc(g: ConvGeom, dy: te.Tensor, w: te.Tensor) -> te.Tensor:
    """dx[n,c,y,x] of the input gradient (te_products.conv2d_grad_input_acc's formula)."""
    ro = te.reduce_axis((0, g.og), "ro")
    ri = te.reduce_axis((0, g.kh), "ri")
    rj = te.reduce_axis((0, g.kw), "rj")

    def axis_tap(v: Expr, r: Expr, s: int, p: int, size: int) -> tuple[Expr, Expr]:
        t = v + p - r
        if s == 1:
            return t, _in(0, t, size)
        ok = tirx.all(t >= 0, tirx.floormod(t, s) == 0, tirx.floordiv(t, s) < size)
        return tirx.floordiv(t, s), ok

    def body(n: Expr, c: Expr, y: Expr, xx: Expr) -> Expr:
        ty, oky = axis_tap(y, ri, g.sh, g.ph, g.oh)
        tx, okx = axis_tap(xx, rj, g.sw, g.pw, g.ow)
        o, cw = ((c // g.cg) * g.og + ro, c % g.cg) if g.groups > 1 else (ro, c)
        prod = _mul(dy[n, o, ty, tx], w[o, cw, ri, rj])
        return te.sum(_guarded(tirx.all(oky, okx), prod), axis=[ro, ri, rj])

    return te.compute(g.x_shape, body, name="acc")


def conv_grad_weight_acc(g: ConvGeom, dy: te.Tensor, x: te.Tensor) -> te.Tensor:
    """dw[o,c',i,j] (te_products.conv2d_grad_weight_acc's formula)."""
    rn = te.reduce_axis((0, g.n), "rn")
    ry = te.reduce_axis((0, g.oh), "ry")
    rx = te.reduce_axis((0, g.ow), "rx")

    def body(o: Expr, cw: Expr, i: Expr, j: Expr) -> Expr:
        iy, ix, ok = _tap(g, ry, rx, i, j)
        c = (o // g.og) * g.cg + cw if g.groups > 1 else cw
        return te.sum(_guarded(ok, _mul(dy[rn, o, ry, rx], x[rn, c, iy, ix])), axis=[rn, ry, rx])

    return te.compute(g.w_shape, body, name="acc")


Value = Callable[..., Expr]  # value(*output index) -> int32, reading the accumulator


def _scan_and_round(
    name: str,
    shape: tuple[int, ...],
    inputs: list[te.Tensor],
    scalars: dict[str, tirx.Var],
    acc: te.Tensor,
    value: Value,
    taps: int,
    unit_first: bool,
) -> dict[str, tirx.PrimFunc]:
    """`{name}_scan` (inputs, scalars, amax[1]) and `{name}_round` (inputs, scalars, s, stoch,
    k0, bits, out): the compaction of value over `shape` without storing it."""
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
        f"{name}_scan": _schedule(scan, "amax", taps, unit_first),
        f"{name}_round": _schedule(rnd, "out", taps, unit_first),
    }


def conv_forward(name: str, g: ConvGeom, bias: bool) -> dict[str, tirx.PrimFunc]:
    """Scan and round of a convolution (a linear layer: a 1x1 convolution on (N, K, 1, 1)),
    with its bias added as docs/numerics.md section 7's aligned sum when `bias`. Operands
    (x, w[, b]); with a bias, scalars ta = t - e_acc, tb = t - e_b, stoch, k1, k2."""
    x = te.placeholder(g.x_shape, I8, name="x")
    w = te.placeholder(g.w_shape, I8, name="w")
    acc = conv_acc(g, x, w)
    if not bias:
        return _scan_and_round(
            name, g.y_shape, [x, w], {}, acc, lambda *i: acc[i], g.kh * g.kw, g.cg == 1
        )
    b = te.placeholder((g.o,), I8, name="b")
    sv = BIAS_SCALARS.vars()

    def aligned(*idx: Expr) -> Expr:
        a = _call(
            I32,
            "mexc_shift_signed",
            acc[idx],
            sv["ta"],
            sv["stoch"],
            sv["k1"],
            _flat(g.y_shape, idx),
        )
        o = idx[1]
        bo = _call(
            I32,
            "mexc_shift_signed",
            b[o].astype(I32),
            sv["tb"],
            sv["stoch"],
            sv["k2"],
            o.astype(U32),
        )
        return a + bo

    return _scan_and_round(name, g.y_shape, [x, w, b], sv, acc, aligned, g.kh * g.kw, g.cg == 1)


def conv_grad_input(name: str, g: ConvGeom) -> dict[str, tirx.PrimFunc]:
    """Scan and round of the input gradient. Operands (dy, w)."""
    dy = te.placeholder(g.y_shape, I8, name="dy")
    w = te.placeholder(g.w_shape, I8, name="w")
    acc = conv_grad_input_acc(g, dy, w)
    return _scan_and_round(
        name, g.x_shape, [dy, w], {}, acc, lambda *i: acc[i], g.kh * g.kw, g.og == 1
    )


def conv_grad_weight(name: str, g: ConvGeom) -> dict[str, tirx.PrimFunc]:
    """The int32 weight gradient `{name}` (dy, x, dw)."""
    dy = te.placeholder(g.y_shape, I8, name="dy")
    x = te.placeholder(g.x_shape, I8, name="x")
    acc = conv_grad_weight_acc(g, dy, x)
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
