"""Products on the host CPU as packed GEMMs (the forms of gemm_forms, re-tiled for SIMD).

    pack_a   A[g, m, k]     the operand gathered K-contiguous (m padded to the tile)
    pack_b   B[g, k, q]     q contiguous (q padded to the tile)
    gemm     C[g, m, q] = sum_k A[g, m, k] * B[g, k, q]     (int32)
    unpack   the native accumulator layout from C

The GEMM runs an MT x QT register tile: for every k it broadcasts MT values of A and multiplies
them with one contiguous QT-wide row of the B panel, so the inner loop is plain SIMD loads,
widening, multiplies and adds with no gather and no bounds test (the gathers, im2col included,
are done once by the packs). Padding rows and columns are zeros that are never read back, so
the accumulator is the exact product; the schedule only reorders exact int32 sums (the caps of
docs/numerics.md rule out overflow), which keeps it bit-exact.

On AVX2 hosts the GEMM instead multiplies bytes (`x86_int8`: `vpmaddubsw` + `vpmaddwd`, 32
multiply-accumulates per instruction pair), which wants four consecutive k of every column
together: pack_b still writes B[g, k, q] (its gathers keep their contiguous rows), and
`interleave_b` regroups it into column panels B4[g, q / QT, k / 4, q % QT, k % 4], each panel
contiguous, with K padded to a multiple of 4 by zeros on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from mexc.lowering.gemm_forms import GemmForm
from mexc.lowering.te_compaction import (
    LANE_REDUCE,
    _flat_index,
    abs_max_slot,
    channel_compacted,
    compacted,
    fit_shift,
    iabs,
    where,
)
from mexc.lowering.te_func import prim_func, trial_cached
from mexc.lowering.te_products import has_block
from mexc.lowering.x86_int8 import BYTE_KERNELS, COLUMNS, DEPTH
from mexc.lowering.x86_int8 import registered as int8_dot_intrinsic
from mexc.numerics import qmax

I8, I32 = "int8", "int32"
MT = 2  # rows of the register tile (2 x 4 vectors measured best on AVX2)
QT_VECTORS = 4  # columns of the tile, in vectors, where the column count allows
PARALLEL_CHUNKS = 64  # parallel tasks a gather or a GEMM is given, at least, where it can
VECTOR_ROW = 32  # innermost elements a gather handles as one vector (int8: one AVX2 register)
VECTOR_WIDTHS = (VECTOR_ROW, 16, 8)  # vector widths a longer row is cut into, where one divides
TRANSPOSE_STRIDE = 64  # bytes between a gather's row elements from which it runs in tiles
TRANSPOSE_TILE = 64  # columns of such a tile (_schedule_pack)
SERIAL_BELOW = 4096  # a block with fewer loop iterations runs on the calling thread
# marks a kernel whose extents are shape variables but whose launches are all small: it runs on
# the calling thread (schedule_parallel), where waking the pool would cost more than the work
SERIAL_ATTR = "mexc.serial"
PADDED_SOURCE = "_source_padded"  # block name suffix of a zero-bordered source copy
PANELS = "panels"  # the block of a GEMM that builds its B panels from rows
PANEL_TASKS = 16  # panels a GEMM needs to build them itself, one per parallel task
COLUMN_TASKS = 16  # parallel bands of rows of a column reduction (_column_reduction)
VECTOR_MIN = 8  # columns a column reduction needs to run them as vectors
LANES = (32, 16, 8)  # widths a lane reduction tries (32: 3.1x, 8: 1.6x on a 64-wide row)
# the longest rows a lane reduction takes: LLVM's own loop wins on long ones (a LayerNorm affine's
# shift in lanes: 3.5x at 64 columns, 1.3x at 192, 0.8x at 784; an aligned sum's: 0.94x at 12,544)
LANE_ROW_MAX = 256
GROUPED_ROWS = 16  # rows per group from which a grouped product pays in bytes (_bytes_pay)
GEMV_SPLIT = 32  # lanes of a one-column product's split reduction (64 measured 9x slower)
# int32 lanes everywhere; byte products on AVX2 hosts, and with vpdpbusd on VNNI hosts
GEMM_KERNELS = ("int32", *BYTE_KERNELS)


def tile_of(m: int, q: int, lanes: int) -> tuple[int, int]:
    """(rows, columns) of the register tile for an m x q GEMM: the preferred 2 x 4 vectors,
    narrowed so that padding does not multiply the work (a 16-column GEMM, e.g. a weight
    gradient with 16 output channels, in 32-wide tiles would compute twice what it needs; odd
    m, e.g. the 9 taps of a depthwise kernel, take 1-row tiles and keep natural packing)."""
    mt = MT if m % MT == 0 else 1
    for vectors in (QT_VECTORS, 2, 1):
        if q % (vectors * lanes) == 0:
            return mt, vectors * lanes
    return mt, (QT_VECTORS if q >= QT_VECTORS * lanes else 1) * lanes


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


@dataclass(frozen=True)
class CpuGemm:
    """The four PrimFuncs of one product and the shapes of the packed buffers. `b_shape` is
    the GEMM's (g, K, Qp) view of B; `b_pack_shape` the shape pack_b writes it with (natural
    axes of K and Q when Q needs no padding, so the im2col gather has no division per element)."""

    pack_a: tirx.PrimFunc
    pack_b: tirx.PrimFunc
    gemm: tirx.PrimFunc
    unpack: tirx.PrimFunc
    a_shape: tuple[int, int, int]
    b_shape: tuple[int, ...]
    a_pack_shape: tuple[int, ...]  # a prefix of A's memory (rows past m stay zero)
    b_pack_shape: tuple[int, ...]
    c_shape: tuple[int, int, int]
    # the byte-product kernel: pack_b writes (g, K, Qp) rows here, interleave_b the panels
    b_rows_shape: tuple[int, int, int] | None = None
    interleave_b: tirx.PrimFunc | None = None

    def module(self) -> tvm.IRModule:
        """The kernels as one module, each under its role's name (pack_a, pack_b,
        interleave_b where there is one, gemm, unpack): for tests and benchmarks that run a
        product outside a plan."""
        funcs = {"pack_a": self.pack_a, "pack_b": self.pack_b, "gemm": self.gemm}
        funcs["unpack"] = self.unpack
        if self.interleave_b is not None:
            funcs["interleave_b"] = self.interleave_b
        return tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


def _flatten(idx: tuple, dims: tuple[int, ...]):
    flat = idx[0]
    for i, d in zip(idx[1:], dims[1:]):
        flat = flat * d + i
    return flat


def _domain(
    shape: tuple[int, ...], last_short: bool = False
) -> tuple[tvm.sym.Analyzer, list[tirx.Var]]:
    """Variables for the output index of a gather over `shape`, bound to their ranges (the
    last one stopping one short when `last_short`, to compare neighbours along it)."""
    analyzer = tvm.sym.Analyzer()
    out_idx = [tirx.Var(f"i{d}", "int32") for d in range(len(shape))]
    for d, (v, extent) in enumerate(zip(out_idx, shape)):
        short = last_short and d == len(shape) - 1
        analyzer.bind(v, tvm.ir.Range(0, max(extent - 1, 1) if short else extent))
    return analyzer, out_idx


def _index_bounds(
    shape: tuple[int, ...], index: Callable[..., tuple], at: Callable[..., tuple]
) -> list[tuple[int, int]]:
    """(min, max) of every source index the gather can compute over its output `shape`
    (TVM's constant-bound analysis: conservative, so a range may be wider than needed)."""
    analyzer, out_idx = _domain(shape)
    idx, _ = at(*index(*out_idx))
    return [
        (int(b.min_value), int(b.max_value))
        for b in (analyzer.const_int_bound(analyzer.simplify(v)) for v in idx)
    ]


def _row_stride(
    shape: tuple[int, ...],
    index: Callable[..., tuple],
    at: Callable[..., tuple],
    src_shape: tuple[int, ...],
) -> int | None:
    """The source elements one step along the gather's innermost output axis moves by, where
    every source index moves by a constant step (a row is a contiguous or strided load, or a
    broadcast), else None. The rows of the input gradient of a strided convolution (a floor
    division by the stride) measured slower as vectors than as scalar code; affine rows,
    strided ones included, faster."""
    analyzer, out_idx = _domain(shape, last_short=True)
    here, _ = at(*index(*out_idx))
    there, _ = at(*index(*out_idx[:-1], out_idx[-1] + 1))
    steps = [analyzer.simplify(b - a) for a, b in zip(here, there)]
    if not all(isinstance(d, tirx.IntImm) for d in steps):
        return None
    stride, total = 1, 0
    for d, extent in zip(reversed(steps), reversed(src_shape)):
        total += int(d.value) * stride
        stride *= int(extent)
    return total


def zero_padded(src: te.Tensor, bounds: list[tuple[int, int]], which: str) -> te.Tensor:
    """`src` copied into a zero-bordered tensor covering `bounds`: element i holds
    src[i + lo] (0 outside src), so a gather from it needs no bounds test on its index."""
    lows = [lo for lo, _ in bounds]
    shape = [hi - lo + 1 for lo, hi in bounds]

    def body(*p):
        idx = [v + lo for v, lo in zip(p, lows)]
        inside = tirx.all(*[tirx.all(i >= 0, i < int(e)) for i, e in zip(idx, src.shape)])
        safe = [tirx.if_then_else(inside, i, 0) for i in idx]
        return tirx.if_then_else(inside, src[tuple(safe)], tirx.const(0, I8))

    return te.compute(shape, body, name=f"{which}{PADDED_SOURCE}")


def _conjuncts(cond: tirx.PrimExpr) -> list[tirx.PrimExpr]:
    if isinstance(cond, tirx.And):
        return _conjuncts(cond.a) + _conjuncts(cond.b)
    return [cond]


def _range_test(term: tirx.PrimExpr, idx: tuple, extents: tuple[int, ...]) -> bool:
    """Whether `term` is `idx[j] >= 0` or `idx[j] < extents[j]` for some j: a test that a
    zero-bordered source answers by itself (out of range reads a zero)."""
    for v, extent in zip(idx, extents):
        if isinstance(term, tirx.GE) and tvm_ffi.structural_equal(term.a, v):
            return isinstance(term.b, tirx.IntImm) and int(term.b.value) == 0
        if isinstance(term, tirx.LT) and tvm_ffi.structural_equal(term.a, v):
            return isinstance(term.b, tirx.IntImm) and int(term.b.value) == extent
    return False


def _gather(
    form: GemmForm,
    which: str,
    shape: tuple[int, ...],
    index: Callable[..., tuple],
    k_padded: bool = False,
) -> tuple[tirx.PrimFunc, int | None]:
    """Pack operand A or B: element (g, r, k) of the form goes where `index` puts it; with
    the source stride of its rows (`_row_stride`; None: not worth vectorizing). `k_padded`:
    the pack runs past the form's K (to a multiple of 4), and those k are zeros.

    Where the gather can index outside its source (convolution padding, padded rows), the
    source is first copied into a zero-bordered tensor, so that the gather itself is an affine
    load that LLVM vectorizes into contiguous loads (a bounds-tested index became a vector
    gather: the im2col packs ran at under 1 GB/s)."""
    src_i, at, rows = (
        (form.a_src, form.a_at, form.m) if which == "a" else (form.b_src, form.b_at, form.q)
    )
    op = form.operands[src_i]
    src = te.placeholder(op.shape, I8, name=op.name)
    bounds = _index_bounds(shape, index, at)
    inside = all(lo >= 0 and hi < extent for (lo, hi), extent in zip(bounds, op.shape))
    padded = src if inside else zero_padded(src, bounds, which)
    lows = [0] * len(bounds) if inside else [lo for lo, _ in bounds]

    def body(*out_idx):
        gi, r, k = index(*out_idx)
        idx, ok = at(gi, r, k)
        shifted = tuple(v - lo for v, lo in zip(idx, lows))
        tests = [r < rows, *_conjuncts(ok), *([k < form.k] if k_padded else [])]
        if not inside:  # the border answers the range tests of the form's validity
            tests = [t for t in tests if not _range_test(t, idx, op.shape)]
        if not tests:  # the border answers them all (e.g. a 3x3 tap of a 1x1 image)
            return padded[shifted]
        return where(tirx.all(*tests), padded[shifted], tirx.const(0, I8))

    packed = te.compute(shape, body, name=f"{which}_packed")
    return _func([src, packed], f"{form.name}_pack_{which}"), _row_stride(
        shape, index, at, tuple(int(d) for d in op.shape)
    )


def _schedule_gemm(func: tirx.PrimFunc, mt: int, qt: int, lanes: int) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("c")
    g, m, q, k = sch.get_loops(blk)
    mo, mi = sch.split(m, [None, mt])
    qo, qi = sch.split(q, [None, qt])
    sch.reorder(g, qo, mo, k, mi, qi)
    # parallel over column panels; where there are few (a weight gradient has one or two, its
    # rows the taps, and ran on one thread), over bands of row tiles too
    outer, tile = _parallel_tasks(sch, g, qo, mo)
    acc = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(acc, tile)
    sch.parallel(outer)
    sch.unroll(mi)
    qv, ql = sch.split(qi, [None, lanes])
    sch.unroll(qv)
    sch.vectorize(ql)
    cw = sch.get_loops(acc)
    sch.vectorize(cw[-1])
    sch.decompose_reduction(blk, k)
    return sch.mod["main"]


def _parallel_tasks(
    sch: s_tir.Schedule,
    g: s_tir.LoopRV,
    qo: s_tir.LoopRV,
    mo: s_tir.LoopRV,
    whole_panels: bool = False,
) -> tuple[s_tir.LoopRV, s_tir.LoopRV]:
    """(the parallel loop, the loop of one register tile) of a GEMM ordered (g, qo, mo, ...):
    a task is one column panel and a band of consecutive row tiles, the widest band that
    still gives PARALLEL_CHUNKS tasks (`whole_panels`: every row tile of a panel). A weight
    gradient has one or two panels and would run on one thread with a task per panel. A task
    per row tile, as before the bands, cost more than its tile where K is short: on a 2-core
    Zen 3 (AVX2 byte kernel, 2026-12-02) 2048 x 64 x 192 ran at 33 GMAC/s with a task per
    tile, 99 with bands, 100 with a task per panel; 3136 x 768 x 192 at 80, 105 and 110."""
    panels = int(sch.get(g).extent) * int(sch.get(qo).extent)
    tiles = int(sch.get(mo).extent)
    if whole_panels or panels >= PARALLEL_CHUNKS:
        return sch.fuse(g, qo), mo
    band = max(
        (
            d
            for d in range(1, tiles + 1)
            if tiles % d == 0 and panels * (tiles // d) >= PARALLEL_CHUNKS
        ),
        default=1,
    )
    bands, tile = sch.split(mo, [tiles // band, band])
    return sch.fuse(g, qo, bands), tile


def _schedule_gemv(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """One dot product per (g, m) along a K padded to GEMV_SPLIT: the reduction split into
    GEMV_SPLIT vector lanes (rfactor) and summed at the end (a 32 x 9 x 25,088 depthwise
    weight gradient: 0.23 ms, against 0.47 ms with LLVM's own loop and 1.3 ms as an 8-column
    padded tile)."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("c")
    g, m, _, k = sch.get_loops(blk)
    sch.parallel(sch.fuse(g, m))
    _, ki = sch.split(k, [None, GEMV_SPLIT])
    sch.vectorize(sch.get_loops(sch.rfactor(ki, 0))[-1])
    return sch.mod["main"]


def _schedule_panel_gemm(func: tirx.PrimFunc, mt: int, qt: int, kernel: str) -> tirx.PrimFunc:
    """The MT x QT register tile of the byte-product kernel: for every 4 k, MT broadcasts of
    4 bytes of A against QT / 8 vectors of the panel, each one tensorized `x86_int8` step.
    Where the GEMM reads B in rows, each parallel task first builds its own panel (QT columns,
    all of K) into a scratch block, from which every row tile of A reads it."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("c")
    g, m, q, k = sch.get_loops(blk)
    mo, mi = sch.split(m, [None, mt])
    qo, qv, q8 = sch.split(q, [None, qt // COLUMNS, COLUMNS])
    k4, kk = sch.split(k, [None, DEPTH])
    sch.reorder(g, qo, mo, k4, mi, qv, q8, kk)
    # a task per panel where it builds its panel (it would rebuild it for every band of row
    # tiles otherwise)
    builds = has_block(sch, PANELS)
    outer, tile = _parallel_tasks(sch, g, qo, mo, whole_panels=builds)
    if builds:
        sch.compute_at(sch.get_sblock(PANELS), outer)
    acc = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(acc, tile)  # one tile
    sch.parallel(outer)
    sch.unroll(mi)
    sch.unroll(qv)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(blk, k4)  # loop kinds are set before, as TVM requires
    sch.tensorize(q8, int8_dot_intrinsic(kernel))
    return sch.mod["main"]


def _schedule_elementwise(
    func: tirx.PrimFunc, vector_rows: bool = True, only: str | None = None
) -> tirx.PrimFunc:
    """Every block parallel over its leading axes, fused until they give PARALLEL_CHUNKS
    iterations (packs, their zero-bordered source copies and the unpack are memory-bound
    gathers). Fusing all outer axes would recover every inner index by division once per
    innermost row: the im2col packs, whose rows are 14 to 28 bytes, spent most of their time
    there."""
    sch = s_tir.Schedule(func)
    for blk in sch.get_child_blocks(sch.get_sblock("root")):
        loops, name = sch.get_loops(blk), sch.get(blk).name_hint
        if only is not None and name != only:
            continue  # (left to schedule_parallel: a reduction's blocks)
        lead, extent = 1, int(sch.get(loops[0]).extent)
        while extent < PARALLEL_CHUNKS and lead < len(loops) - 1:
            extent *= int(sch.get(loops[lead]).extent)
            lead += 1
        sch.parallel(sch.fuse(*loops[:lead]) if lead > 1 else loops[0])
        if vector_rows and lead < len(loops) and not name.endswith(PADDED_SOURCE):
            inner = loops[-1]
            extent = int(sch.get(inner).extent)
            if extent > VECTOR_ROW:
                # a width that divides the row: a split that does not leaves a bounds test in
                # the vector loop, which LLVM scalarized (the compaction of a 3136 x 48
                # product's C: 0.62 ms in 32-wide pieces, 4x slower per element than at 64
                # columns); rows with no such width are left to LLVM's own vectorizer
                width = next((w for w in VECTOR_WIDTHS if extent % w == 0), 0)
                if not width:
                    continue
                _, inner = sch.split(inner, [None, width])
            sch.vectorize(inner)
    return sch.mod["main"]


def _schedule_pack(func: tirx.PrimFunc, stride: int | None) -> tirx.PrimFunc:
    """A pack's schedule: `_schedule_elementwise`, except for a transposing gather (rows read
    down a source column, TRANSPOSE_STRIDE bytes apart or more) of (g, rows, k) with k a
    multiple of TRANSPOSE_TILE: it runs in column tiles, every row of the tile before the
    next tile, so that the tile's source lines stay in L1 while all rows read them. The A
    pack of a linear weight gradient (dy transposed, 6272 x 144, 2-core Zen 3, 2026-12-02):
    1.07 ms a row at a time, 0.35 ms in 64-wide tiles; 6272 x 48 (48 bytes apart) the same
    either way."""
    if stride is None or abs(stride) < TRANSPOSE_STRIDE:
        return _schedule_elementwise(func, stride is not None)
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    loops = sch.get_loops(blocks[0]) if len(blocks) == 1 else []
    extent = sch.get(loops[-1]).extent if len(loops) == 3 else None
    if not isinstance(extent, tirx.IntImm) or int(extent) % TRANSPOSE_TILE:
        return _schedule_elementwise(func, True)
    if int(extent) < PARALLEL_CHUNKS * TRANSPOSE_TILE // 4:
        return _schedule_elementwise(func, True)
    g, rows, k = loops
    tiles, tile = sch.split(k, [None, TRANSPOSE_TILE])
    sch.reorder(g, tiles, rows, tile)
    sch.parallel(sch.fuse(g, tiles))
    return sch.mod["main"]


def swapped(form: GemmForm) -> GemmForm:
    """The same product with A and B exchanged: C^T[g, q, m] = sum_k B[g, q, k] A[g, m, k]."""

    def out_at(*idx):
        gi, mm, qq = form.out_at(*idx)
        return gi, qq, mm

    return replace(
        form,
        m=form.q,
        q=form.m,
        a_src=form.b_src,
        a_at=form.b_at,
        b_src=form.a_src,
        b_at=form.a_at,
        out_at=out_at,
    )


@trial_cached(lambda form, *rest: (form.key(), *rest))
def cpu_gemm(
    form: GemmForm,
    lanes: int,
    k_dims: tuple[int, ...] | None = None,
    q_dims: tuple[int, ...] | None = None,
    m_dims: tuple[int, ...] | None = None,
    kernel: str = "int32",
) -> CpuGemm:
    """The packed-GEMM PrimFuncs of `form`, scheduled for `lanes` int32 lanes per vector.
    m_dims / k_dims / q_dims: the natural axes whose C-order flattening is the form's m / k / q
    index; with them the packs loop over those axes and need no division per element.
    `kernel`: one of GEMM_KERNELS (the byte kernels need an AVX2 or a VNNI host and 8 lanes)."""
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {GEMM_KERNELS}")
    if kernel in BYTE_KERNELS and lanes != COLUMNS:
        raise ValueError(f"the {kernel} GEMM works on {COLUMNS} int32 lanes, not {lanes}")
    # one column per group (a depthwise weight gradient): dot products along K, not a tile
    # that would pad the column to a vector and multiply 8x the work
    gemv = form.q == 1
    panels = kernel in BYTE_KERNELS and _bytes_pay(form) and not gemv
    mt, qt = (1, 1) if gemv else tile_of(form.m, form.q, lanes)
    mp, qp, k = _round_up(form.m, mt), _round_up(form.q, qt), form.k
    kp = _round_up(k, DEPTH) if panels else _round_up(k, GEMV_SPLIT) if gemv else k
    a_shape = (form.g, mp, kp)
    rows_shape = (form.g, kp if gemv else k, qp)  # the byte kernel's interleave pads K itself
    panel_shape = (form.g, qp // qt, kp // DEPTH, qt, DEPTH)
    # enough panels for the GEMM's parallel tasks: each builds its own from the rows, and no
    # whole-product panel copy of B is stored (half the pack memory, and measured as fast)
    in_gemm = panels and form.g * (qp // qt) >= PANEL_TASKS
    b_shape: tuple[int, ...] = panel_shape if panels and not in_gemm else rows_shape
    if m_dims is not None and k_dims is not None and (mp == form.m or form.g == 1) and kp == k:
        a_pack_shape: tuple[int, ...] = (form.g, *m_dims, *k_dims)
        nm = len(m_dims)

        def a_index(gi, *rest):
            return gi, _flatten(rest[:nm], m_dims), _flatten(rest[nm:], k_dims)

        pack_a, stride_a = _gather(form, "a", a_pack_shape, a_index)
    else:
        a_pack_shape = a_shape
        pack_a, stride_a = _gather(form, "a", a_shape, lambda gi, r, kk: (gi, r, kk), kp > k)
    natural = k_dims is not None and q_dims is not None and qp == form.q and (panels or kp == k)
    if natural:
        assert k_dims is not None and q_dims is not None
        b_pack_shape: tuple[int, ...] = (form.g, *k_dims, *q_dims)
        nk = len(k_dims)

        def b_index(gi, *rest):
            kk = _flatten(rest[:nk], k_dims)
            qq = _flatten(rest[nk:], q_dims)
            return gi, qq, kk

        pack_b, stride_b = _gather(form, "b", b_pack_shape, b_index)
    else:
        b_pack_shape = rows_shape
        k_padded = rows_shape[1] > k
        pack_b, stride_b = _gather(form, "b", rows_shape, lambda gi, kk, qq: (gi, qq, kk), k_padded)
    if gemv:
        gemm = _schedule_gemv(_row_gemm(form.name, a_shape, rows_shape))
        interleave = None
    elif in_gemm:
        gemm_func = _panel_gemm(form.name, a_shape, panel_shape, rows_shape)
        gemm = _schedule_panel_gemm(gemm_func, mt, qt, kernel)
        interleave = None
    elif panels:
        gemm = _schedule_panel_gemm(_panel_gemm(form.name, a_shape, b_shape), mt, qt, kernel)
        interleave = _schedule_elementwise(_interleave(form.name, rows_shape, b_shape), False)
    else:
        gemm = _schedule_gemm(_row_gemm(form.name, a_shape, rows_shape), mt, qt, lanes)
        interleave = None
    cin = te.placeholder((form.g, mp, qp), I32, name="c")

    def unpack_body(*idx):
        gi, mm, qq = form.out_at(*idx)
        return cin[gi, mm, qq]

    out = te.compute(form.out_shape, unpack_body, name="acc")
    unpack = _func([cin, out], f"{form.name}_unpack")

    def named(func: tirx.PrimFunc, suffix: str) -> tirx.PrimFunc:
        return func.with_attr("global_symbol", f"{form.name}_{suffix}")

    return CpuGemm(
        named(_schedule_pack(pack_a, stride_a), "pack_a"),
        named(_schedule_pack(pack_b, stride_b), "pack_b"),
        named(gemm, "gemm"),
        named(_schedule_elementwise(unpack), "unpack"),
        a_shape,
        b_shape,
        a_pack_shape,
        b_pack_shape,
        (form.g, mp, qp),
        rows_shape if interleave is not None else None,
        named(interleave, "interleave_b") if interleave is not None else None,
    )


def compact_from_c(
    form: GemmForm,
    c_shape: tuple[int, int, int],
    bits: int,
    stochastic: bool,
    name: str,
    offset: bool = False,
    schedule: bool = True,
) -> tirx.PrimFunc:
    """The compaction apply of a product read straight from its GEMM's C (the unpack's gather
    with the rounding on the way): m[idx] = compacted(C[out_at(idx)], s), keyed by the native
    flat index as compaction_apply is. C's padding is zero, so the compaction shift can take
    its max over C too, and the int32 accumulator in the native layout is never written.
    Parameters (c, s, key, m); with `offset` (c, s, key, off, m): the keys' flat indices start
    at off[0] (a chunk of a lean product: its piece of the whole result). `schedule`: the
    host's elementwise schedule (off for a GPU, whose backend schedules every kernel)."""
    cin = te.placeholder(c_shape, I32, name="c")
    s_in = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), "int64", name="key")
    off = te.placeholder((1,), "int64", name="off")

    def body(*idx):
        flat = _flat_index(form.out_shape, idx) + (off[0] if offset else 0)
        return compacted(cin[form.out_at(*idx)], s_in[0], key[0], flat, bits, stochastic)

    m = te.compute(form.out_shape, body, name="m")
    params = [cin, s_in, key, off, m] if offset else [cin, s_in, key, m]
    func = _func(params, f"{name}_apply")
    return _schedule_elementwise(func) if schedule else func


def scan_compact_from_c(
    form: GemmForm,
    c_shape: tuple[int, int, int],
    bits: int,
    slot: int,
    name: str,
    schedule: bool = True,
) -> tirx.PrimFunc:
    """One chunk of a stochastic lean compaction in one kernel (PlanBuilder.lean_compaction):
    its max |C| into amax[0] (a slot of `slot` int32, zeros after it), its own shift s_j into
    s[0], and m rounded by s_j as compact_from_c rounds (keys' flat indices from off[0]), while
    the chunk's C is in the caches. Parameters (c as (g * m, q) rows, key, off, m, amax, s).
    `schedule`: the host's elementwise schedule for m (the maxima: schedule_parallel's)."""
    # C as its rows (g * m, q): the maxima run over the rows in parallel
    cin = te.placeholder((c_shape[0] * c_shape[1], c_shape[2]), I32, name="c")
    key = te.placeholder((1,), "int64", name="key")
    off = te.placeholder((1,), "int64", name="off")
    top, amax = abs_max_slot(cin, slot)
    s = fit_shift(top, qmax(bits), "s")

    def body(*idx):
        flat = _flat_index(form.out_shape, idx) + off[0]
        g, row, q = form.out_at(*idx)
        return compacted(cin[g * c_shape[1] + row, q], s[0], key[0], flat, bits, True)

    m = te.compute(form.out_shape, body, name="m")
    func = _func([cin, key, off, m, amax, s], f"{name}_scan_apply")
    return _schedule_elementwise(func, only="m") if schedule else func


def channel_max_from_c(
    form: GemmForm, c_shape: tuple[int, int, int], slot: int, name: str
) -> tirx.PrimFunc:
    """Channel exponents' maxima (te_channels) of a product read straight from its GEMM's C:
    amax[c] = max |C[out_at(idx)]| over the indices idx of form.out_shape with idx[1] = c, in a
    slot of `slot` int32 (zeros past the channels: slots of a lean product's chunks are 64-byte
    aligned). Parameters (c, amax)."""
    cin = te.placeholder(c_shape, I32, name="c")
    out = form.out_shape
    channels = out[1]
    axes = [te.reduce_axis((0, d), f"r{i}") for i, d in enumerate(out) if i != 1]

    def at(c: tirx.PrimExpr) -> tirx.PrimExpr:
        idx = (axes[0], c, *axes[1:])
        v = cin[form.out_at(*idx)]
        return te.max(iabs(v), axis=axes)

    amax = te.compute((channels,), at, name="amax_c")
    zero = tirx.const(0, I32)
    top = tirx.const(channels - 1, "int32")
    padded = te.compute(
        (slot,),
        lambda i: tirx.Select(i < channels, amax[tirx.min(i, top)], zero),
        name="amax",
    )
    return _func([cin, padded], f"{name}_amax")


def channel_compact_from_c(
    form: GemmForm,
    c_shape: tuple[int, int, int],
    stochastic: bool,
    name: str,
    offset: bool = False,
    schedule: bool = True,
) -> tirx.PrimFunc:
    """compact_from_c with channel exponents (te_channels.channel_apply): m[idx] =
    saturate(round(C[out_at(idx)] >> sh[c]), 8) << up[c], c = idx[1]; every channel's rounding
    fits qmax(B), so the int8 bound clips nothing. Parameters (c, sh, up, key, m); with
    `offset` (c, sh, up, key, off, m)."""
    cin = te.placeholder(c_shape, I32, name="c")
    channels = form.out_shape[1]
    sh = te.placeholder((channels,), I32, name="sh")
    up = te.placeholder((channels,), I32, name="up")
    key = te.placeholder((1,), "int64", name="key")
    off = te.placeholder((1,), "int64", name="off")

    def body(*idx):
        flat = _flat_index(form.out_shape, idx) + (off[0] if offset else 0)
        c = idx[1]
        return channel_compacted(cin[form.out_at(*idx)], sh[c], up[c], key[0], flat, stochastic)

    m = te.compute(form.out_shape, body, name="m")
    params = [cin, sh, up, key, off, m] if offset else [cin, sh, up, key, m]
    func = _func(params, f"{name}_apply")
    return _schedule_elementwise(func) if schedule else func


def _product(
    name: str,
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    columns: int,
    b_at: Callable[..., tirx.PrimExpr],
    b_of: Callable[[te.Tensor], te.Tensor] = lambda b: b,
) -> tirx.PrimFunc:
    """C[g, m, q] = sum_k A[g, m, k] * B(g, k, q) in int32, B read through `b_at` from
    `b_of(b)`: the parameter b itself, or a tensor the GEMM computes from it."""
    a = te.placeholder(a_shape, I8, name="a")
    b = te.placeholder(b_shape, I8, name="b")
    src = b_of(b)
    rk = te.reduce_axis((0, a_shape[2]), "rk")

    def body(gi, mm, qq):
        return te.sum(a[gi, mm, rk].astype(I32) * b_at(src, gi, rk, qq).astype(I32), axis=rk)

    c = te.compute((a_shape[0], a_shape[1], columns), body, name="c")
    return _func([a, b, c], f"{name}_gemm")


def _row_gemm(name: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tirx.PrimFunc:
    """The product with B in rows (g, K, Qp), q contiguous."""
    return _product(name, a_shape, b_shape, b_shape[2], lambda b, gi, k, q: b[gi, k, q])


def _panel_gemm(
    name: str,
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    rows_shape: tuple[int, int, int] | None = None,
) -> tirx.PrimFunc:
    """The product with B in column panels (g, Qp / QT, Kp / 4, QT, 4). With `rows_shape`, B
    comes in rows (g, K, Qp) and the panels are a block of the GEMM itself (`interleaved`),
    which its schedule builds one panel at a time (`_schedule_panel_gemm`)."""
    qt = b_shape[3]

    def b_at(b: te.Tensor, gi: tirx.PrimExpr, k: tirx.PrimExpr, q: tirx.PrimExpr) -> tirx.PrimExpr:
        return b[gi, q // qt, k // DEPTH, q % qt, k % DEPTH]

    if rows_shape is None:
        return _product(name, a_shape, b_shape, b_shape[1] * qt, b_at)
    return _product(
        name, a_shape, rows_shape, b_shape[1] * qt, b_at, lambda rows: interleaved(rows, b_shape)
    )


def _bytes_pay(form: GemmForm) -> bool:
    """Whether the byte-product kernel beats the int32 tile on `form`: products with K >= 16,
    ungrouped or with GROUPED_ROWS rows or more per group (attention's batched products);
    grouped ones with fewer rows (depthwise convolutions, their sub-pixel phases) only with a
    deep K (their weight gradients). With one or two rows per group and K = 9 the byte
    kernel's tile accumulator went to a heap workspace per task: a 32-group depthwise forward
    took 7.7 ms against 2.1 ms; a 32-group 9 x 25,088 x 32 weight gradient 7.9 against
    16.7 ms. A first convolution (K = 9, padded to 12) measured 0.77-0.94x; K = 16 even
    (bench/research/gemm_kernels.py). 192 groups of 49 x 16 x 49 (a ViT's q k^T, 2-core Zen 3,
    2026-12-02): 0.31 ms as int32 tiles, 0.15 ms in bytes; 8 rows per group 1.1x slower in
    bytes, 16 rows 1.2x faster."""
    if form.g == 1 or form.m >= GROUPED_ROWS:
        return form.k >= 16
    return form.k >= 256 and form.k % DEPTH == 0


def interleaved(rows: te.Tensor, b_shape: tuple[int, ...]) -> te.Tensor:
    """B rows (g, K, Qp) as column panels (g, Qp / QT, Kp / 4, QT, 4), zeros for k >= K."""
    k, qt = int(rows.shape[1]), b_shape[3]
    padded = b_shape[2] * DEPTH > k

    def body(gi, qo, k4, qi, kk):
        kr = k4 * DEPTH + kk
        if not padded:
            return rows[gi, kr, qo * qt + qi]
        value = rows[gi, tirx.min(kr, k - 1), qo * qt + qi]  # a load inside the rows
        return where(kr < k, value, tirx.const(0, I8))

    return te.compute(b_shape, body, name=PANELS)


def _interleave(name: str, rows_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tirx.PrimFunc:
    """The panels of B as a kernel of their own (products with too few panels to build them
    inside the GEMM's parallel loop)."""
    rows = te.placeholder(rows_shape, I8, name="rows")
    return _func([rows, interleaved(rows, b_shape)], f"{name}_interleave_b")


def _iterations(sch: s_tir.Schedule, loops: list) -> float:
    """Loop iterations of a block (infinite where an extent is a shape variable)."""
    total = 1.0
    for lp in loops:
        extent = sch.get(lp).extent
        if not isinstance(extent, tirx.IntImm):
            return float("inf")
        total *= int(extent)
    return total


def _unit(extent: Any) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def _column_reduction(sch: s_tir.Schedule, blk: Any) -> bool:
    """Schedule a sum or max over leading axes whose kept axes end in every read's contiguous
    one (bias and LayerNorm parameter gradients: columns of a (rows, D) tensor), if `blk` is
    one: the rows split into COLUMN_TASKS parallel bands (rfactor), each adding whole rows
    into a vector of partial column results, then the bands combined. The plain schedule ran
    one column per task down a stride of D bytes: a 2048 x 64 bias gradient took 75 us, 5 us
    this way. Exact: integer sums and maxima in any order."""
    block = sch.get(blk)
    loops = sch.get_loops(blk)
    kinds = [iv.iter_type for iv in block.iter_vars]
    if len(loops) != len(kinds) or 2 not in kinds or kinds != sorted(kinds):
        return False  # not spatial loops then reduce loops, one per iter var
    keep = [iv.var for iv, k in zip(block.iter_vars, kinds) if k == 0]
    if not keep or any(
        not tvm_ffi.structural_equal(r.region[-1].min, keep[-1]) for r in block.reads
    ):
        return False
    reduce = [lp for lp, k in zip(loops, kinds) if k == 2]
    rows = _iterations(sch, reduce)
    bands = next((b for b in (COLUMN_TASKS, 8, 4, 2) if rows % b == 0 and rows >= 8 * b), 0)
    columns = sch.get(loops[len(keep) - 1]).extent
    if not bands or not isinstance(columns, tirx.IntImm) or int(columns) < VECTOR_MIN:
        return False  # (a shape variable's extent: the symbolic update kernels)
    if _iterations(sch, loops) < SERIAL_BELOW:
        return False  # (a batch norm's per-channel sum of its (N, C) partials) stays serial
    band, _ = sch.split(sch.fuse(*reduce) if len(reduce) > 1 else reduce[0], [bands, None])
    rf = sch.rfactor(band, 0)
    rf_loops = sch.get_loops(rf)  # the kept axes, the band, the rows in a band
    cols = rf_loops[: len(keep)]
    sch.reorder(rf_loops[len(keep)], rf_loops[len(keep) + 1], *cols)
    sch.parallel(rf_loops[len(keep)])
    sch.vectorize(cols[-1])
    sch.decompose_reduction(rf, rf_loops[len(keep) + 1])
    return True


def _lane_reduction(sch: s_tir.Schedule, blk: Any) -> bool:
    """Schedule a reduction marked LANE_REDUCE (te_compaction: the max or sum of a value
    computed along a contiguous last axis of at most LANE_ROW_MAX), if `blk` is one: the axis
    split into LANES-wide vectors of partial results (rfactor), the rows in parallel. LLVM left such
    short loops scalar where the value has a rounding's hash in it: a 2048 x 64 LayerNorm
    affine's shift took 216 us, 70 us in lanes; its apply, the same values vectorized, 45 us.
    A row's lanes are computed inside the loop that reduces them: stored for every row, they
    were batch-sized workspace (16 int32 per row of a batch norm's (N, C) sums, 2.4 MB for a
    MobileNetV3-Small layer at batch 128)."""
    block = sch.get(blk)
    if LANE_REDUCE not in block.annotations:
        return False
    loops = sch.get_loops(blk)
    kinds = [iv.iter_type for iv in block.iter_vars]
    extent = sch.get(loops[-1]).extent
    if kinds[-1] != 2 or kinds.count(2) != 1 or not isinstance(extent, tirx.IntImm):
        return False
    lanes = next((v for v in LANES if int(extent) % v == 0), 0)
    if not lanes or int(extent) > LANE_ROW_MAX:
        return False
    _, lane = sch.split(loops[-1], [None, lanes])
    rf = sch.rfactor(lane, len(loops) - 1)
    spatial = sch.get_loops(blk)[:-1]
    if spatial:  # a row's partial results inside the loop over rows that reduces them
        sch.compute_at(rf, spatial[-1], preserve_unit_loops=True)
        # its own loops, one per iter var in their order: the lanes first, the vectors last
        own = sch.get_loops(rf)[len(spatial) :]
        kinds = [iv.iter_type for iv in sch.get(rf).iter_vars]
        vectors = own[kinds.index(2)]
        lane = next(lp for lp, k in zip(own, kinds) if k == 0 and not _unit(sch.get(lp).extent))
        sch.reorder(vectors, lane)
    else:  # the spatial loops, the vectors, the lanes
        *_, vectors, lane = sch.get_loops(rf)
    outer = next((lp for lp in spatial if not _unit(sch.get(lp).extent)), None)
    if outer is not None and _iterations(sch, sch.get_loops(rf)) >= SERIAL_BELOW:
        sch.parallel(outer)  # rows in parallel where it pays
    sch.vectorize(lane)
    sch.decompose_reduction(rf, vectors)
    return True


def _partial_maxima_per_row(sch: s_tir.Schedule, blk: Any) -> bool:
    """te_compaction._max_rows' partial maxima (one per row of its last axis, int32) computed
    row by row of the result inside the loop that reduces them, where no lane reduction takes
    them (a last axis under 8): stored whole, they were a workspace TVM allocates outside the
    arena, half the int32 accumulator of a strided gradient's merge (3.2 MB for SmallResNet at
    batch 128); a row's are one sample's. Returns whether it placed `blk` so."""
    name = sch.get(blk).name_hint
    if not name.endswith("_part"):
        return False
    loops = sch.get_loops(blk)
    extent = sch.get(loops[-1]).extent
    if not isinstance(extent, tirx.IntImm) or int(extent) >= min(LANES):
        return False
    consumers = sch.get_consumers(blk)
    if len(consumers) != 1:
        return False
    sch.compute_at(blk, sch.get_loops(consumers[0])[0])
    return True


def schedule_parallel(func: tirx.PrimFunc, min_extent: int = 2) -> tirx.PrimFunc:
    """A generic host schedule for the non-product kernels: every root-level block runs its
    outermost spatial loop in parallel (reductions keep their reduce loops inside, per output
    element; column reductions `_column_reduction`, short marked rows `_lane_reduction`);
    the inner loops stay as they are for LLVM's vectorizer. Blocks whose outer extent is below
    `min_extent` (per-tensor reductions, one-element exponents) stay serial, and so does a
    kernel marked SERIAL_ATTR (the update of a small parameter over symbolic shapes)."""
    if func.attrs is not None and SERIAL_ATTR in func.attrs:
        return func
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root") if has_block(sch, "root") else None
    blocks = sch.get_child_blocks(root) if root is not None else []
    placed = {sch.get(blk).name_hint for blk in blocks if _partial_maxima_per_row(sch, blk)}
    blocks = sch.get_child_blocks(root) if root is not None else []
    for blk in blocks:
        if sch.get(blk).name_hint in placed:
            continue  # inside its consumer's loop: scheduled with it
        loops = sch.get_loops(blk)
        kinds = [sch.get(lp).kind for lp in loops]
        if any(k != tirx.ForKind.SERIAL for k in kinds):
            continue  # scheduled by the kernel itself (te_func.a_row_at_a_time)
        if _column_reduction(sch, blk) or _lane_reduction(sch, blk):
            continue
        iters = sch.get(blk).iter_vars
        spatial = [lp for lp, iv in zip(loops, iters) if iv.iter_type == 0]
        if not spatial or len(spatial) != len([iv for iv in iters if iv.iter_type == 0]):
            continue
        # the outermost loop whose extent is not 1 (a (1, R, D) LayerNorm's statistics have a
        # unit batch axis in front of their rows)
        outer = 0
        while outer + 1 < len(spatial) and _unit(sch.get(spatial[outer]).extent):
            outer += 1
        if spatial[outer] != loops[outer]:
            continue
        extent = sch.get(spatial[outer]).extent
        if isinstance(extent, tirx.IntImm) and int(extent) < min_extent:
            continue  # (a shape variable's extent is taken to be large)
        if _iterations(sch, loops) < SERIAL_BELOW:
            continue  # waking the pool costs more than the work
        sch.parallel(spatial[outer])  # the outer axis only: fusing would divide every index
    return sch.mod["main"]
