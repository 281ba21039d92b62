"""Integer product kernels of a training step as TVM tensor expressions.

Every product is a pure int32 accumulation of int8 mantissas: no rounding, no saturation (the
compaction epilogue is separate). Shapes are static. Layouts are C-order contiguous: activations
NCHW, conv weights OIHW (O, C/G, KH, KW), linear weights (O, K). Zero padding, dilation 1.

Each builder returns an unscheduled PrimFunc whose `global_symbol` is `name` and whose
parameters are the inputs followed by the output, named as in the formulas below; the reduction
block has the name of the output (`acc_block`). The schedules
(`schedule_mcu`, and the host CPU ones in `tvm_llvm_products`) take such a PrimFunc.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import s_tir, te, tirx

from mexc.lowering.te_func import prim_func

IntPair = int | tuple[int, int]

I8 = "int8"
I32 = "int32"


def _pair(v: IntPair) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class ConvGeom:
    """Static geometry of a grouped 2-D convolution."""

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    groups: int

    @classmethod
    def of(
        cls,
        n: int,
        c: int,
        h: int,
        w: int,
        o: int,
        kh: int,
        kw: int,
        stride: IntPair = 1,
        padding: IntPair = 0,
        groups: int = 1,
    ) -> ConvGeom:
        sh, sw = _pair(stride)
        ph, pw = _pair(padding)
        g = cls(n, c, h, w, o, kh, kw, sh, sw, ph, pw, groups)
        if min(n, c, h, w, o, kh, kw, sh, sw, groups) < 1 or min(ph, pw) < 0:
            raise ValueError(f"bad convolution geometry {g}")
        if c % groups or o % groups:
            raise ValueError(f"groups={groups} must divide C={c} and O={o}")
        if g.oh < 1 or g.ow < 1:
            raise ValueError(f"convolution output is empty for {g}")
        return g

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.ph - self.kh) // self.sh + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.pw - self.kw) // self.sw + 1

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def og(self) -> int:
        return self.o // self.groups

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.o, self.cg, self.kh, self.kw)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.o, self.oh, self.ow)


def _mul(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    return a.astype(I32) * b.astype(I32)


def _guarded(cond: tirx.PrimExpr, value: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.if_then_else(cond, value, tirx.const(0, I32))


def _in(lo: int, v: tirx.PrimExpr, hi: int) -> tirx.PrimExpr:
    """lo <= v < hi."""
    return tirx.all(v >= lo, v < hi)


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


def _tap(geom: ConvGeom, y: tirx.PrimExpr, x: tirx.PrimExpr, i: tirx.Var, j: tirx.Var):
    """Input coordinates read by output (y, x) through kernel tap (i, j), and their validity."""
    iy = y * geom.sh + i - geom.ph
    ix = x * geom.sw + j - geom.pw
    return iy, ix, tirx.all(_in(0, iy, geom.h), _in(0, ix, geom.w))


def conv2d_acc(
    N: int,
    C: int,
    H: int,
    W: int,
    O: int,  # noqa: E741
    KH: int,
    KW: int,
    stride: IntPair = 1,
    padding: IntPair = 0,
    groups: int = 1,
    name: str = "conv2d_acc",
) -> tirx.PrimFunc:
    """acc[n,o,y,x] = sum_{c',i,j} x[n, g*C/G+c', y*s+i-p, x*s+j-p] * w[o,c',i,j], g = o // (O/G).

    Parameters (x, w, acc) with shapes (N,C,H,W), (O,C/G,KH,KW), (N,O,OH,OW).
    """
    g = ConvGeom.of(N, C, H, W, O, KH, KW, stride, padding, groups)
    x = te.placeholder(g.x_shape, I8, name="x")
    w = te.placeholder(g.w_shape, I8, name="w")
    return _func([x, w, conv_forward_sum(g, x, w)], name)


def conv_forward_sum(g: ConvGeom, x: te.Tensor, w: te.Tensor, name: str = "acc") -> te.Tensor:
    """The forward convolution's int32 sums (conv2d_acc's formula) over tensors x, w."""
    rc = te.reduce_axis((0, g.cg), "rc")
    ri = te.reduce_axis((0, g.kh), "ri")
    rj = te.reduce_axis((0, g.kw), "rj")

    def body(n, o, y, xx):
        iy, ix, ok = _tap(g, y, xx, ri, rj)
        c = (o // g.og) * g.cg + rc if g.groups > 1 else rc
        return te.sum(_guarded(ok, _mul(x[n, c, iy, ix], w[o, rc, ri, rj])), axis=[rc, ri, rj])

    return te.compute(g.y_shape, body, name=name)


def conv2d_grad_input_acc(
    N: int,
    C: int,
    H: int,
    W: int,
    O: int,  # noqa: E741
    KH: int,
    KW: int,
    stride: IntPair = 1,
    padding: IntPair = 0,
    groups: int = 1,
    name: str = "conv2d_grad_input_acc",
) -> tirx.PrimFunc:
    """Transposed convolution: dx[n,c,y,x] = sum_{o',i,j} dy[n,o,ty/s,tx/s] * w[o,c',i,j] with
    ty = y+p-i, tx = x+p-j, over the taps where ty, tx are non-negative multiples of s inside dy;
    o = g*O/G+o', g = c // (C/G), c' = c % (C/G).

    Parameters (dy, w, dx) with shapes (N,O,OH,OW), (O,C/G,KH,KW), (N,C,H,W); the geometry
    arguments are those of the forward convolution.
    """
    g = ConvGeom.of(N, C, H, W, O, KH, KW, stride, padding, groups)
    dy = te.placeholder(g.y_shape, I8, name="dy")
    w = te.placeholder(g.w_shape, I8, name="w")
    return _func([dy, w, conv_grad_input_sum(g, dy, w, "dx")], name)


def axis_tap(v, r, s: int, p: int, size: int):
    """The dy row (or column) that input row v reads through tap r, and whether it exists."""
    t = v + p - r
    if s == 1:
        return t, _in(0, t, size)
    ok = tirx.all(t >= 0, tirx.floormod(t, s) == 0, tirx.floordiv(t, s) < size)
    return tirx.floordiv(t, s), ok


def conv_grad_input_sum(g: ConvGeom, dy: te.Tensor, w: te.Tensor, name: str = "acc") -> te.Tensor:
    """The input gradient's int32 sums (conv2d_grad_input_acc's formula) over tensors dy, w."""
    ro = te.reduce_axis((0, g.og), "ro")
    ri = te.reduce_axis((0, g.kh), "ri")
    rj = te.reduce_axis((0, g.kw), "rj")

    def body(n, c, y, xx):
        ty, oky = axis_tap(y, ri, g.sh, g.ph, g.oh)
        tx, okx = axis_tap(xx, rj, g.sw, g.pw, g.ow)
        if g.groups > 1:
            o = (c // g.cg) * g.og + ro
            cw = c % g.cg
        else:
            o, cw = ro, c
        prod = _mul(dy[n, o, ty, tx], w[o, cw, ri, rj])
        return te.sum(_guarded(tirx.all(oky, okx), prod), axis=[ro, ri, rj])

    return te.compute(g.x_shape, body, name=name)


def conv2d_grad_weight_acc(
    N: int,
    C: int,
    H: int,
    W: int,
    O: int,  # noqa: E741
    KH: int,
    KW: int,
    stride: IntPair = 1,
    padding: IntPair = 0,
    groups: int = 1,
    name: str = "conv2d_grad_weight_acc",
) -> tirx.PrimFunc:
    """dw[o,c',i,j] = sum_{n,y,x} dy[n,o,y,x] * x[n, g*C/G+c', y*s+i-p, x*s+j-p], g = o // (O/G).

    Parameters (dy, x, dw) with shapes (N,O,OH,OW), (N,C,H,W), (O,C/G,KH,KW).
    """
    g = ConvGeom.of(N, C, H, W, O, KH, KW, stride, padding, groups)
    dy = te.placeholder(g.y_shape, I8, name="dy")
    x = te.placeholder(g.x_shape, I8, name="x")
    return _func([dy, x, conv_grad_weight_sum(g, dy, x, "dw")], name)


def conv_grad_weight_sum(g: ConvGeom, dy: te.Tensor, x: te.Tensor, name: str = "acc") -> te.Tensor:
    """The weight gradient's int32 sums (conv2d_grad_weight_acc's formula) over tensors dy, x."""
    rn = te.reduce_axis((0, g.n), "rn")
    ry = te.reduce_axis((0, g.oh), "ry")
    rx = te.reduce_axis((0, g.ow), "rx")

    def body(o, cw, i, j):
        iy, ix, ok = _tap(g, ry, rx, i, j)
        c = (o // g.og) * g.cg + cw if g.groups > 1 else cw
        return te.sum(_guarded(ok, _mul(dy[rn, o, ry, rx], x[rn, c, iy, ix])), axis=[rn, ry, rx])

    return te.compute(g.w_shape, body, name=name)


def linear_acc(N: int, K: int, O: int, name: str = "linear_acc") -> tirx.PrimFunc:  # noqa: E741
    """acc[n,o] = sum_k x[n,k] * w[o,k]. Parameters (x, w, acc): (N,K), (O,K), (N,O)."""
    x = te.placeholder((N, K), I8, name="x")
    w = te.placeholder((O, K), I8, name="w")
    rk = te.reduce_axis((0, K), "rk")
    acc = te.compute((N, O), lambda n, o: te.sum(_mul(x[n, rk], w[o, rk]), axis=rk), name="acc")
    return _func([x, w, acc], name)


def linear_grad_input_acc(
    N: int,
    K: int,
    O: int,  # noqa: E741
    name: str = "linear_grad_input_acc",
) -> tirx.PrimFunc:
    """dx[n,k] = sum_o dy[n,o] * w[o,k]. Parameters (dy, w, dx): (N,O), (O,K), (N,K)."""
    dy = te.placeholder((N, O), I8, name="dy")
    w = te.placeholder((O, K), I8, name="w")
    ro = te.reduce_axis((0, O), "ro")
    dx = te.compute((N, K), lambda n, k: te.sum(_mul(dy[n, ro], w[ro, k]), axis=ro), name="dx")
    return _func([dy, w, dx], name)


def linear_grad_weight_acc(
    N: int,
    K: int,
    O: int,  # noqa: E741
    name: str = "linear_grad_weight_acc",
) -> tirx.PrimFunc:
    """dw[o,k] = sum_n dy[n,o] * x[n,k]. Parameters (dy, x, dw): (N,O), (N,K), (O,K)."""
    dy = te.placeholder((N, O), I8, name="dy")
    x = te.placeholder((N, K), I8, name="x")
    rn = te.reduce_axis((0, N), "rn")
    dw = te.compute((O, K), lambda o, k: te.sum(_mul(dy[rn, o], x[rn, k]), axis=rn), name="dw")
    return _func([dy, x, dw], name)


ConvBuilder = Callable[..., tirx.PrimFunc]
CONV_PRODUCTS: dict[str, ConvBuilder] = {
    "conv2d_acc": conv2d_acc,
    "conv2d_grad_input_acc": conv2d_grad_input_acc,
    "conv2d_grad_weight_acc": conv2d_grad_weight_acc,
}
LINEAR_PRODUCTS: dict[str, Callable[..., tirx.PrimFunc]] = {
    "linear_acc": linear_acc,
    "linear_grad_input_acc": linear_grad_input_acc,
    "linear_grad_weight_acc": linear_grad_weight_acc,
}


@dataclass(frozen=True)
class Param:
    """One buffer parameter of a product PrimFunc."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def params(func: tirx.PrimFunc) -> list[Param]:
    """The buffer parameters of `func` in ABI order (inputs first, the int32 output last)."""
    return [Param(p.name, tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params]


def has_block(sch: s_tir.Schedule, name: str) -> bool:
    """Whether the scheduled function has a block of that name."""
    try:
        sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - TVM raises its own error type for a missing block
        return False
    return True


def acc_block(func: tirx.PrimFunc) -> str:
    """Name of the reduction block of a product: that of its output parameter."""
    return str(func.params[-1].name)


def schedule_mcu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Schedule for a small in-order core: output loops in layout order, the whole reduction
    innermost, accumulating in a one-element scratch (a register after `cc -O2`). The scratch is
    `global` scope because TVM's C codegen rejects `local`."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock(acc_block(func))
    loops = sch.get_loops(blk)
    n_spatial = len(func.params[-1].shape)
    scratch = sch.cache_write(blk, 0, "global")
    sch.reverse_compute_at(scratch, loops[n_spatial - 1])
    sch.decompose_reduction(blk, loops[n_spatial])
    return sch.mod["main"]
