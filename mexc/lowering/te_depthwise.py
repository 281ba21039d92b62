"""Depthwise convolutions (one input and one output channel per group) as direct host kernels.

As a GEMM a depthwise 3x3 convolution is one row of 9 taps per channel against an im2col of 9
shifted copies of its input: the pack writes nine bytes per input byte and the GEMM's one-row
tile reads them back. Here every output row is the sum of KH x KW shifted rows of a
zero-bordered copy of the input, times one weight each, accumulated in int32 registers along the
row: exact (at most 2^7 * 2^7 * KH * KW, far inside int32), so bit-identical to the GEMM.

    acc[n, c, y, x] = sum_{i, j} w[c, i, j] * x[n, c, y * sh + i - ph, x * sw + j - pw]

The input gradient of a stride-1 depthwise convolution is the same kernel on dy with the kernel
flipped and padding KH - 1 - ph (`flipped`).
"""

from __future__ import annotations

from tvm import s_tir, te, tirx

from mexc.lowering.cpu_gemm import PADDED_SOURCE, zero_padded
from mexc.lowering.te_func import prim_func
from mexc.lowering.te_products import ConvGeom

I8, I16, I32 = "int8", "int16", "int32"
BORDERED = f"x{PADDED_SOURCE}"  # the block of the zero-bordered input copy
MAX_ROWS_WRITTEN_OUT = 32  # output rows a weight gradient's written-out sum may have


def applies(g: ConvGeom) -> bool:
    """Whether `g` is depthwise: one input and one output channel per group."""
    return g.groups == g.c == g.o


def applies_to_input_gradient(g: ConvGeom) -> bool:
    """Whether the input gradient of `g` is a depthwise convolution of dy (`flipped`)."""
    return applies(g) and (g.sh, g.sw) == (1, 1) and g.ph < g.kh and g.pw < g.kw


def flipped(g: ConvGeom) -> ConvGeom:
    """The convolution whose output is the input gradient of stride-1 `g`: over dy, the same
    channels, the kernel rotated by 180 degrees, padding KH - 1 - ph."""
    if (g.sh, g.sw) != (1, 1):
        raise ValueError("only a stride-1 depthwise convolution's input gradient is one")
    return ConvGeom.of(
        g.n, g.o, g.oh, g.ow, g.c, g.kh, g.kw, 1, (g.kh - 1 - g.ph, g.kw - 1 - g.pw), g.groups
    )


def depthwise_acc(g: ConvGeom, name: str, flip: bool = False) -> tirx.PrimFunc:
    """acc (N, C, OH, OW) int32 of depthwise `g`; `flip`: the weight is read rotated by 180
    degrees (an input gradient, see `flipped`). Parameters (x, w, acc); w is (C, 1, KH, KW)."""
    if not applies(g):
        raise ValueError(f"not a depthwise convolution: {g}")
    x = te.placeholder((g.n, g.c, g.h, g.w), I8, name="x")
    w = te.placeholder((g.c, 1, g.kh, g.kw), I8, name="w")
    xb = _bordered(x, g)

    def tap(c, i: int, j: int):
        return w[c, 0, g.kh - 1 - i, g.kw - 1 - j] if flip else w[c, 0, i, j]

    def body(n, c, y, xx):
        # the taps written out (no reduce axis): the row loop is then a plain vector loop;
        # each product in int16 (|.| <= 2^14: twice the lanes of int32), summed in int32
        total: tirx.PrimExpr = tirx.const(0, I32)
        for i in range(g.kh):
            for j in range(g.kw):
                v = xb[n, c, y * g.sh + i, xx * g.sw + j].astype(I16)
                total = total + (v * tap(c, i, j).astype(I16)).astype(I32)
        return total

    acc = te.compute((g.n, g.c, g.oh, g.ow), body, name="acc")
    return _schedule(prim_func([x, w, acc], name))


def _bordered(x: te.Tensor, g: ConvGeom) -> te.Tensor:
    """x with a zero border: every (row, column) a tap of `g` reads, so the taps are affine
    loads with no bounds test (block BORDERED, scheduled per plane)."""
    hp = (g.oh - 1) * g.sh + g.kh
    wp = (g.ow - 1) * g.sw + g.kw
    bounds = [(0, g.n - 1), (0, g.c - 1), (-g.ph, hp - 1 - g.ph), (-g.pw, wp - 1 - g.pw)]
    return zero_padded(x, bounds, "x")


def _schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Parallel over (n, c) planes; per plane the bordered copy (kept in L1), then the output
    rows, each a vector loop over x."""
    sch = s_tir.Schedule(func)
    n, c, _, x = sch.get_loops(sch.get_sblock("acc"))
    plane = sch.fuse(n, c)
    sch.parallel(plane)
    sch.compute_at(sch.get_sblock(BORDERED), plane)
    sch.vectorize(x)
    _vectorize_innermost(sch, BORDERED)
    return sch.mod["main"]


def _vectorize_innermost(sch: s_tir.Schedule, block: str, at: int = 1) -> None:
    """Vectorize the innermost loop of `block`, computed at a loop `at` deep (the parallel
    plane loop: 1), if it has one of its own: compute_at drops unit loops, so a one-element
    copy per plane (a 1x1 output of a 1x1 kernel) has none, and its last loop would be the
    loop it was computed at."""
    loops = sch.get_loops(sch.get_sblock(block))
    if len(loops) > at:
        sch.vectorize(loops[-1])


def depthwise_weight_grad(g: ConvGeom, name: str) -> tirx.PrimFunc:
    """dw (C, 1, KH, KW) int32 of depthwise `g`: per (n, c) plane and tap, the sum over y of
    dy rows times shifted rows of the bordered input, kept per x (a vector along the row), then
    summed over x and over n. The sum over y is written out (no reduce axis), so the row stays
    a plain vector loop; `applies_to_weight_grad` bounds OH. The channels run in parallel,
    each adding its samples' planes one at a time: a plane per (n, c), stored whole, was
    batch-sized workspace (MobileNetV3-Small's 5 x 5 layers, 3.7 MB at batch 128).
    Parameters (dy, x, dw)."""
    if not applies_to_weight_grad(g):
        raise ValueError(f"no direct weight gradient for {g}")
    dy = te.placeholder((g.n, g.c, g.oh, g.ow), I8, name="dy")
    x = te.placeholder((g.n, g.c, g.h, g.w), I8, name="x")
    xb = _bordered(x, g)

    def rows(n, c, i, j, xx):
        total: tirx.PrimExpr = tirx.const(0, I32)
        for y in range(g.oh):
            v = xb[n, c, y * g.sh + i, xx * g.sw + j].astype(I16) * dy[n, c, y, xx].astype(I16)
            total = total + v.astype(I32)
        return total

    by_x = te.compute((g.n, g.c, g.kh, g.kw, g.ow), rows, name="by_x")
    rx = te.reduce_axis((0, g.ow), "rx")
    plane = te.compute(
        (g.n, g.c, g.kh, g.kw), lambda n, c, i, j: te.sum(by_x[n, c, i, j, rx], axis=rx), "plane"
    )
    rn = te.reduce_axis((0, g.n), "rn")
    dw = te.compute(
        (g.c, 1, g.kh, g.kw), lambda c, _, i, j: te.sum(plane[rn, c, i, j], axis=rn), name="dw"
    )
    sch = s_tir.Schedule(prim_func([dy, x, dw], name))
    c, _, i, j, n = sch.get_loops(sch.get_sblock("dw"))
    sch.reorder(n, i, j)  # per channel, the samples outside the taps
    sch.parallel(c)
    for block in ("plane", "by_x", BORDERED):
        sch.compute_at(sch.get_sblock(block), n)
    _vectorize_innermost(sch, "by_x", 3)  # under (c, the unit axis, n)
    _vectorize_innermost(sch, BORDERED, 3)
    return sch.mod["main"]


def applies_to_weight_grad(g: ConvGeom) -> bool:
    """Whether depthwise `g`'s weight gradient is taken by `depthwise_weight_grad` (its sum
    over the output rows is written out, so OH is bounded)."""
    return applies(g) and g.oh <= MAX_ROWS_WRITTEN_OUT
