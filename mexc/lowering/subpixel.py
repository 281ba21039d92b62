"""The input gradient of a strided convolution in sub-pixel form: one GEMM per output phase.

dx[n, c, y, x] = sum over o, i, j of w[o, c, i, j] * dy[n, o, ty, tx] where y + ph - i = sh * ty
(and the same along x). As one GEMM over every tap (gemm_forms.conv_grad_input) a stride of 2
in both axes makes three quarters of the (tap, pixel) pairs meet no dy element: the gather
yields zeros that the GEMM multiplies anyway, and the gather itself divides by the stride.
Split by phase (py, px) = (y mod sh, x mod sw), only the taps with i = py + ph (mod sh) and
j = px + pw (mod sw) reach the pixels of a phase, and for them ty = y' + cy - ii where
y = sh * y' + py: an affine gather. Each phase is a GEMM of its own (K = output channels x its
taps) into a phase buffer (n, c, h / sh, w / sw); `merge_compaction` interleaves the phase
buffers and compacts them, never storing the merged accumulator. The sums are the same exact
int32 sums, so the result is bit-identical to the one-GEMM form.

Used where h and w are multiples of the strides (every strided convolution of the examples);
other shapes keep the one-GEMM form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm import te, tirx

from mexc.lowering.gemm_forms import GemmForm, Operand
from mexc.lowering.te_compaction import (
    _flat_index,
    channel_compacted,
    compacted,
    fused_compaction,
)
from mexc.lowering.te_func import prim_func
from mexc.lowering.te_products import ConvGeom

I32 = "int32"


@dataclass(frozen=True)
class Phase:
    """One output phase: its offsets, its GEMM form (None: no tap reaches it, its dx is 0), and
    the natural axes of the form's K (out channels, tap rows, tap columns) and Q (n, y', x')."""

    py: int
    px: int
    form: GemmForm | None
    k_dims: tuple[int, ...]
    q_dims: tuple[int, ...]


def applies(g: ConvGeom) -> bool:
    """Whether the sub-pixel form serves this convolution's input gradient."""
    return (g.sh > 1 or g.sw > 1) and g.h % g.sh == 0 and g.w % g.sw == 0


def _taps(phase: int, pad: int, stride: int, kernel: int) -> tuple[int, int, int]:
    """(first tap, tap count, offset c) of a phase along one axis: taps first + stride * t, and
    the dy index of tap t at phase pixel p is p + c - t."""
    first = (phase + pad) % stride
    count = len(range(first, kernel, stride))
    return first, count, (phase + pad - first) // stride


def _form(name: str, g: ConvGeom, py: int, px: int) -> Phase:
    i0, ni, cy = _taps(py, g.ph, g.sh, g.kh)
    j0, nj, cx = _taps(px, g.pw, g.sw, g.kw)
    hc, wc = g.h // g.sh, g.w // g.sw
    q_dims = (g.n, hc, wc)
    k_dims = (g.og, ni, nj)
    if ni == 0 or nj == 0:
        return Phase(py, px, None, k_dims, q_dims)
    taps, pixels = ni * nj, hc * wc

    def a_at(gi, m, k):
        o, ii, jj = k // taps, (k % taps) // nj, k % nj
        return (gi * g.og + o, m, i0 + g.sh * ii, j0 + g.sw * jj), tirx.const(True, "bool")

    def b_at(gi, q, k):
        n, yy, xx = q // pixels, (q % pixels) // wc, q % wc
        o, ii, jj = k // taps, (k % taps) // nj, k % nj
        ty, tx = yy + cy - ii, xx + cx - jj
        ok = tirx.all(ty >= 0, ty < g.oh, tx >= 0, tx < g.ow)
        return (n, gi * g.og + o, ty, tx), ok

    def out_at(n, c, yy, xx):
        return c // g.cg, c % g.cg, (n * hc + yy) * wc + xx

    ops = (Operand("dy", g.y_shape), Operand("w", g.w_shape))
    out_shape = (g.n, g.c, hc, wc)
    form = GemmForm(
        f"{name}_p{py}{px}", ops, out_shape, g.groups, g.cg, g.n * pixels, g.og * taps,
        1, a_at, 0, b_at, out_at,
    )  # fmt: skip
    return Phase(py, px, form, k_dims, q_dims)


def phases(name: str, g: ConvGeom) -> list[Phase]:
    """Every output phase of the input gradient of `g`, in (py, px) order."""
    return [_form(name, g, py, px) for py in range(g.sh) for px in range(g.sw)]


def merge_compaction(
    g: ConvGeom, present: list[Phase], bits: int, stochastic: bool, name: str, agreed: int = 0
) -> tuple[tirx.PrimFunc, ...]:
    """The phase buffers (one parameter per phase with a form, in order; 0 where no tap
    reaches) interleaved into the accumulator seen by phase, (n, c, h/sh, sh, w/sw, sw), and
    compacted without storing it (te_compaction.fused_compaction): `<name>_shift` (phase
    buffers, e_in, s, e_out) and `<name>_apply` (phase buffers, e_in, s, key, m), m the int8
    result seen by phase. The by-phase shape's C-order flat index is the native one, so the
    rounding keys are those of a compaction of the accumulator. `agreed`: fused_compaction's
    data-parallel form."""
    bufs, shape, body = _merged(g, present)
    e_in = te.placeholder((1,), I32, name="e_in")
    return fused_compaction(shape, [*bufs, e_in], e_in, body, bits, stochastic, name, agreed)


def _merged(g: ConvGeom, present: list[Phase]) -> tuple[list[te.Tensor], tuple[int, ...], Any]:
    """The phase placeholders, the by-phase shape and its element."""
    hc, wc = g.h // g.sh, g.w // g.sw
    bufs = {
        (p.py, p.px): te.placeholder((g.n, g.c, hc, wc), I32, name=f"p{p.py}{p.px}")
        for p in present
        if p.form is not None
    }
    reads = [(qy, qx, _reader(buf)) for (qy, qx), buf in bufs.items()]
    return list(bufs.values()), (g.n, g.c, hc, g.sh, wc, g.sw), _interleave(reads)


Read = Callable[[Any, Any, Any, Any], Any]  # (n, c, y', x') -> a phase's element (PrimExpr)


def _reader(buf: te.Tensor, form: GemmForm | None = None) -> Read:
    """A phase's element (n, c, y', x') from its buffer, or from its GEMM's C (form.out_at)."""
    if form is None:
        return lambda n, c, yy, xx: buf[n, c, yy, xx]
    return lambda n, c, yy, xx: buf[form.out_at(n, c, yy, xx)]


def _interleave(reads: list[tuple[int, int, Read]]) -> Callable[..., tirx.PrimExpr]:
    """Element (n, c, y', py, x', px) of the accumulator seen by phase, from each phase's
    (py, px, read)."""

    def body(n, c, yy, py, xx, px):
        # the phases are exclusive: an OR of masked loads (branch-free; a chain of selects
        # would repeat its tail in both arms and grow as 2^phases)
        value = tirx.const(0, I32)
        for qy, qx, read in reads:
            mask = -(tirx.all(py == qy, px == qx).astype(I32))
            value = value | (read(n, c, yy, xx) & mask)
        return value

    return body


def merge_from_c(
    g: ConvGeom,
    present: list[Phase],
    c_shapes: list[tuple[int, int, int]],
    bits: int,
    stochastic: bool,
    name: str,
    channels: bool = False,
) -> tirx.PrimFunc:
    """The lean merge's apply for the samples of `g` (one chunk of the batch): every phase read
    straight from its GEMM's C (form.out_at), interleaved as merge_compaction does and rounded,
    keyed by the by-phase flat index plus off[0] (the chunk's first element in the whole
    result). Parameters (one C per phase with a form, in order, s, key, off, m by phase).
    `channels` (channel exponents, te_channels.channel_apply): each channel c rounded by its
    shift sh[c] and lifted by up[c]; parameters (the Cs, sh, up, key, off, m)."""
    hc, wc = g.h // g.sh, g.w // g.sw
    forms = [p for p in present if p.form is not None]
    cs = [te.placeholder(shape, I32, name=f"c{p.py}{p.px}") for p, shape in zip(forms, c_shapes)]
    s_in = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), "int64", name="key")
    off = te.placeholder((1,), "int64", name="off")
    shape = (g.n, g.c, hc, g.sh, wc, g.sw)

    merged = _interleave([(p.py, p.px, _reader(buf, p.form)) for p, buf in zip(forms, cs)])

    sh = te.placeholder((g.c,), I32, name="sh")
    up = te.placeholder((g.c,), I32, name="up")

    def body(n, c, yy, py, xx, px):
        flat = _flat_index(shape, (n, c, yy, py, xx, px)) + off[0]
        v = merged(n, c, yy, py, xx, px)
        if not channels:
            return compacted(v, s_in[0], key[0], flat, bits, stochastic)
        return channel_compacted(v, sh[c], up[c], key[0], flat, stochastic)

    m = te.compute(shape, body, name="m")
    scales = [sh, up] if channels else [s_in]
    return prim_func([*cs, *scales, key, off, m], f"{name}_apply")
