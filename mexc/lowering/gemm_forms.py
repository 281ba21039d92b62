"""Every integer product of a training step as a packed, padded batched GEMM (TVM TE).

    C[g, m, q] = sum_k A[g, m, k] * B[g, q, k]        int8 x int8 -> int32, k innermost

A product node (conv / linear forward, input gradient, weight gradient; the batched matmul of
attention) becomes four PrimFuncs: `pack_a` and `pack_b` gather the operands from their native
C-order layouts into zero-padded K-contiguous tiles (im2col for convolutions), `gemm` is the plain
batched NT GEMM with every extent a multiple of the tile sizes, and `unpack` scatters C back into
the native int32 accumulator layout that the compaction epilogue reads. Padding is zeros in K
(adds nothing) and unused rows/columns in M and Q (never read back), so the accumulator equals
the direct product exactly; GPU schedules only reorder exact int32 sums (the caps of
docs/numerics.md section 6 rule out overflow), which is why the result is bit-exact whatever the
schedule. Group g indexes convolution groups (depthwise: one per channel) and attention batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tvm import te, tirx

from mexc.lowering.te_func import prim_func, trial_cached
from mexc.lowering.te_products import ConvGeom

I8, I32 = "int8", "int32"
TILE_MQ = 64  # M and Q are padded to multiples of the GEMM block tile
TILE_K = 16  # K is padded to a multiple of the shared-memory K tile (and of dp4a's 4)

Expr = Any  # a TIR expression (tvm.tirx has no public PrimExpr type to name at run time)
Gather = Callable[..., tuple[tuple[Expr, ...], Expr]]


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


@dataclass(frozen=True)
class Operand:
    """A native operand: placeholder name and shape (C-order int8)."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GemmForm:
    """A product as a padded batched GEMM plus the gathers around it.

    A is gathered from operand a_src, B from operand b_src: a_at(g, m, k) / b_at(g, q, k) return
    (index tuple into that operand, validity); out_at(*native output index) returns (g, m, q) of C.
    Extents g, m, q, k are the real (unpadded) ones.
    """

    name: str
    operands: tuple[Operand, Operand]
    out_shape: tuple[int, ...]
    g: int
    m: int
    q: int
    k: int
    a_src: int
    a_at: Gather
    b_src: int
    b_at: Gather
    out_at: Callable[..., tuple[Expr, Expr, Expr]]
    # split-K: the GEMM runs over `parts` slices of K as parts * g groups of partial Cs, which
    # the unpack sums (split_k); 1: one GEMM over the whole of K
    parts: int = 1

    def key(self) -> tuple[object, ...]:
        """What the form's buffers and kernel names follow from (the gathers aside): a trial
        plan's key for its kernels (te_func.trial_cached)."""
        f = self
        return (f.name, f.operands, f.out_shape, f.g, f.m, f.q, f.k, f.a_src, f.b_src, f.parts)

    @property
    def mp(self) -> int:
        return _round_up(self.m, TILE_MQ)

    @property
    def qp(self) -> int:
        return _round_up(self.q, TILE_MQ)

    @property
    def kpart(self) -> int:
        """The real K of one part (the last may hold less)."""
        return -(-self.k // self.parts)

    @property
    def kp(self) -> int:
        """The padded K of the GEMM: of one part under split-K."""
        if self.parts == 1:
            return _round_up(self.k, TILE_K)
        return _round_up(self.kpart, 2 * TILE_K)  # two K fragments per step (cuda.products)

    @property
    def gp(self) -> int:
        """The GEMM's groups: g, or g * parts under split-K."""
        return self.g * self.parts

    @property
    def c_shape(self) -> tuple[int, int, int]:
        return (self.gp, self.mp, self.qp)

    @property
    def macs(self) -> int:
        return self.g * self.m * self.q * self.k


def _true() -> tirx.PrimExpr:
    return tirx.const(True, "bool")


def _in(lo: int, v: tirx.PrimExpr, hi: int) -> tirx.PrimExpr:
    return tirx.all(v >= lo, v < hi)


# ------------------------------------------------------------------------------ the six forms


def conv_forward(name: str, geom: ConvGeom) -> GemmForm:
    """acc[n,o,y,x]: A = weights (g, o', (c',i,j)), B = im2col (g, (n,y,x), (c',i,j))."""
    g = geom
    kk, p = g.kh * g.kw, g.oh * g.ow

    def a_at(gi, m, k):
        return (gi * g.og + m, k // kk, (k % kk) // g.kw, k % g.kw), _true()

    def b_at(gi, q, k):
        n, y, x = q // p, (q % p) // g.ow, q % g.ow
        c, i, j = k // kk, (k % kk) // g.kw, k % g.kw
        iy, ix = y * g.sh + i - g.ph, x * g.sw + j - g.pw
        ok = tirx.all(_in(0, iy, g.h), _in(0, ix, g.w))
        return (n, gi * g.cg + c, iy, ix), ok

    def out_at(n, o, y, x):
        return o // g.og, o % g.og, (n * g.oh + y) * g.ow + x

    ops = (Operand("x", g.x_shape), Operand("w", g.w_shape))
    return GemmForm(
        name, ops, g.y_shape, g.groups, g.og, g.n * p, g.cg * kk, 1, a_at, 0, b_at, out_at
    )


def conv_grad_input(name: str, geom: ConvGeom) -> GemmForm:
    """dx[n,c,y,x]: A = weights (g, c', (o',i,j)), B = transposed-conv gather of dy."""
    g = geom
    kk, hw = g.kh * g.kw, g.h * g.w

    def a_at(gi, m, k):
        return (gi * g.og + k // kk, m, (k % kk) // g.kw, k % g.kw), _true()

    def axis(v, r, s, pad, size):
        t = v + pad - r
        if s == 1:
            return t, _in(0, t, size)
        return tirx.floordiv(t, s), tirx.all(t >= 0, tirx.floormod(t, s) == 0, t < s * size)

    def b_at(gi, q, k):
        n, y, x = q // hw, (q % hw) // g.w, q % g.w
        o, i, j = k // kk, (k % kk) // g.kw, k % g.kw
        ty, oky = axis(y, i, g.sh, g.ph, g.oh)
        tx, okx = axis(x, j, g.sw, g.pw, g.ow)
        return (n, gi * g.og + o, ty, tx), tirx.all(oky, okx)

    def out_at(n, c, y, x):
        return c // g.cg, c % g.cg, (n * g.h + y) * g.w + x

    ops = (Operand("dy", g.y_shape), Operand("w", g.w_shape))
    return GemmForm(
        name, ops, g.x_shape, g.groups, g.cg, g.n * hw, g.og * kk, 1, a_at, 0, b_at, out_at
    )


def conv_grad_weight(name: str, geom: ConvGeom) -> GemmForm:
    """dw[o,c',i,j]: A = dy (g, o', (n,y,x)), B = im2col^T (g, (c',i,j), (n,y,x))."""
    g = geom
    kk, p = g.kh * g.kw, g.oh * g.ow

    def a_at(gi, m, k):
        return (k // p, gi * g.og + m, (k % p) // g.ow, k % g.ow), _true()

    def b_at(gi, q, k):
        n, y, x = k // p, (k % p) // g.ow, k % g.ow
        c, i, j = q // kk, (q % kk) // g.kw, q % g.kw
        iy, ix = y * g.sh + i - g.ph, x * g.sw + j - g.pw
        ok = tirx.all(_in(0, iy, g.h), _in(0, ix, g.w))
        return (n, gi * g.cg + c, iy, ix), ok

    def out_at(o, c, i, j):
        return o // g.og, o % g.og, (c * g.kh + i) * g.kw + j

    ops = (Operand("dy", g.y_shape), Operand("x", g.x_shape))
    return GemmForm(
        name, ops, g.w_shape, g.groups, g.og, g.cg * kk, g.n * p, 0, a_at, 1, b_at, out_at
    )


def c_is_out(form: GemmForm, c_shape: tuple[int, int, int]) -> bool:
    """Whether a GEMM's C[g, m, q] (`c_shape`, padded to its tiles) is laid out exactly as the
    form's accumulator: one group, no padding, and out_at the identity (acc[r, c] = C[0, r, c],
    as for a linear layer), so that the GEMM can write the accumulator itself."""
    if form.gp != 1 or len(form.out_shape) != 2 or tuple(c_shape) != (1, *form.out_shape):
        return False
    r, c = tirx.Var("r", "int32"), tirx.Var("c", "int32")
    at = form.out_at(r, c)
    return (
        len(at) == 3
        and isinstance(at[0], (int, tirx.IntImm))
        and int(at[0]) == 0
        and at[1].same_as(r)
        and at[2].same_as(c)
    )


def linear_forward(name: str, n: int, k: int, o: int) -> GemmForm:
    """acc[n,o] = sum_k x[n,k] w[o,k]: A = x, B = w."""
    return GemmForm(
        name,
        (Operand("x", (n, k)), Operand("w", (o, k))),
        (n, o),
        1,
        n,
        o,
        k,
        0,
        lambda gi, m, kk: ((m, kk), _true()),
        1,
        lambda gi, q, kk: ((q, kk), _true()),
        lambda r, c: (0, r, c),
    )


def linear_grad_input(name: str, n: int, k: int, o: int) -> GemmForm:
    """dx[n,k] = sum_o dy[n,o] w[o,k]: A = dy, B = w^T."""
    return GemmForm(
        name,
        (Operand("dy", (n, o)), Operand("w", (o, k))),
        (n, k),
        1,
        n,
        k,
        o,
        0,
        lambda gi, m, r: ((m, r), _true()),
        1,
        lambda gi, q, r: ((r, q), _true()),
        lambda r, c: (0, r, c),
    )


def linear_grad_weight(name: str, n: int, k: int, o: int) -> GemmForm:
    """dw[o,k] = sum_n dy[n,o] x[n,k]: A = dy^T, B = x^T."""
    return GemmForm(
        name,
        (Operand("dy", (n, o)), Operand("x", (n, k))),
        (o, k),
        1,
        o,
        k,
        n,
        0,
        lambda gi, m, r: ((r, m), _true()),
        1,
        lambda gi, q, r: ((r, q), _true()),
        lambda r, c: (0, r, c),
    )


def matmul_dims(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(batch, M, K, N) of a [..., M, K] @ b [..., K, N]: the batch is the product of the leading
    axes."""
    batch = 1
    for d in a[:-2]:
        batch *= int(d)
    return batch, int(a[-2]), int(a[-1]), int(b[-1])


def batched_matmul(
    name: str, b: int, m: int, k: int, n: int, trans_a: bool = False, trans_b: bool = False
) -> GemmForm:
    """out[b,i,j] = sum_r x[b,i,r] y[b,r,j]; x is given as (b,k,m) when trans_a, y as (b,n,k)
    when trans_b (the two gradients of a batched matmul read a transposed operand)."""
    x_shape = (b, k, m) if trans_a else (b, m, k)
    y_shape = (b, n, k) if trans_b else (b, k, n)

    def a_at(gi, i, r):
        return ((gi, r, i) if trans_a else (gi, i, r)), _true()

    def b_at(gi, q, r):
        return ((gi, q, r) if trans_b else (gi, r, q)), _true()

    ops = (Operand("x", x_shape), Operand("y", y_shape))
    return GemmForm(name, ops, (b, m, n), b, m, n, k, 0, a_at, 1, b_at, lambda bi, i, j: (bi, i, j))


# ------------------------------------------------------------------------------ PrimFuncs


@dataclass(frozen=True)
class GemmFuncs:
    """The four PrimFuncs of one product, in launch order, with their global symbols."""

    form: GemmForm
    pack_a: tirx.PrimFunc
    pack_b: tirx.PrimFunc
    gemm: tirx.PrimFunc
    unpack: tirx.PrimFunc

    def items(self) -> list[tuple[str, tirx.PrimFunc]]:
        f = self.form.name
        return [
            (f"{f}_pack_a", self.pack_a),
            (f"{f}_pack_b", self.pack_b),
            (f"{f}_gemm", self.gemm),
            (f"{f}_unpack", self.unpack),
        ]


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


def _pack(form: GemmForm, which: str) -> tirx.PrimFunc:
    """Gather A or B into a zero-padded (g, rows_p, kp) int8 tile array."""
    src_index, at, rows, rows_p = (
        (form.a_src, form.a_at, form.m, form.mp)
        if which == "a"
        else (form.b_src, form.b_at, form.q, form.qp)
    )
    op = form.operands[src_index]
    src = te.placeholder(op.shape, I8, name=op.name)

    def body(gp, r, kk):
        gi, k, conds = gp, kk, [r < rows]
        if form.parts > 1:  # group gp holds part gp % parts of group gp // parts's K
            gi, k = gp // form.parts, (gp % form.parts) * form.kpart + kk
            conds.append(kk < form.kpart)
        idx, ok = at(gi, r, k)
        valid = tirx.all(*conds, k < form.k, ok)
        safe = tuple(tirx.if_then_else(valid, v, 0) for v in idx)  # never read out of range
        return tirx.if_then_else(valid, src[safe], tirx.const(0, I8))

    packed = te.compute((form.gp, rows_p, form.kp), body, name=f"{which}_packed")
    return _func([src, packed], f"{form.name}_pack_{which}")


def gemm_func(g: int, mp: int, qp: int, kp: int, name: str) -> tirx.PrimFunc:
    """C[g,m,q] = sum_k A[g,m,k] B[g,q,k] on padded extents."""
    a = te.placeholder((g, mp, kp), I8, name="a_packed")
    b = te.placeholder((g, qp, kp), I8, name="b_packed")
    rk = te.reduce_axis((0, kp), "rk")
    c = te.compute(
        (g, mp, qp),
        lambda gi, m, q: te.sum(a[gi, m, rk].astype(I32) * b[gi, q, rk].astype(I32), axis=rk),
        name="c",
    )
    return _func([a, b, c], name)


def _c_at(form: GemmForm, c: te.Tensor, idx: tuple) -> Expr:
    """The product at native output index `idx` from C: under split-K the sum of the parts'
    partial Cs (exact: int32 sums wrap modulo 2^32 in any order, and the caps bound the whole
    sum)."""
    gi, m, q = form.out_at(*idx)
    total = c[gi * form.parts, m, q]
    for part in range(1, form.parts):
        total = total + c[gi * form.parts + part, m, q]
    return total


def _unpack(form: GemmForm) -> tirx.PrimFunc:
    c = te.placeholder(form.c_shape, I32, name="c")
    out = te.compute(form.out_shape, lambda *idx: _c_at(form, c, idx), name="acc")
    return _func([c, out], f"{form.name}_unpack")


@trial_cached(lambda form: form.key())
def gemm_funcs(form: GemmForm) -> GemmFuncs:
    return GemmFuncs(
        form,
        _pack(form, "a"),
        _pack(form, "b"),
        gemm_func(form.gp, form.mp, form.qp, form.kp, f"{form.name}_gemm"),
        _unpack(form),
    )


# split-K (GPU GEMMs): a GEMM launch should have at least this many 64 x 64 output tiles (two
# thread blocks for each of an H200's 132 SMs), and each part at least this much of K
SPLIT_TILES = 256
SPLIT_K_MIN = 1024


def split_k(form: GemmForm) -> GemmForm:
    """`form` with its K split into parts where its C has too few tiles to keep a GPU busy
    and K is long (a weight gradient: a 64 x 576 C is 9 tiles, each walking K = 16,384 batch
    positions on one SM while the rest idle): parts * tiles up to SPLIT_TILES, every part
    keeping SPLIT_K_MIN of K; the partial Cs, at most SPLIT_TILES tiles (4 MiB), are summed
    by the unpack."""
    tiles = form.g * (form.mp // TILE_MQ) * (form.qp // TILE_MQ)
    parts = min(SPLIT_TILES // tiles, form.k // SPLIT_K_MIN)
    return replace(form, parts=parts) if parts > 1 else form


def chunks_in_c(chunk: GemmForm, count: int) -> GemmForm:
    """The product of `count` batch chunks of `chunk` (a product whose output's leading axis is
    the batch) as read from their Cs side by side, (count * g, m, q): out_shape the whole
    output, out_at(n, ...) chunk n // nb's (g, m, q) at sample n % nb."""
    nb = chunk.out_shape[0]

    def out_at(n, *rest):
        gi, m, q = chunk.out_at(n % nb, *rest)
        return (n // nb) * chunk.g + gi, m, q

    shape = (count * nb, *chunk.out_shape[1:])
    return replace(chunk, out_shape=shape, out_at=out_at)


def accumulate_unpack(form: GemmForm, c_shape: tuple[int, int, int], name: str) -> tirx.PrimFunc:
    """acc[idx] = acc_in[idx] + C[out_at(idx)]: a product whose reduction runs over batch chunks
    (a weight gradient) adds each later chunk's C to the native accumulator, in place (the plan
    binds acc_in and acc to one buffer; each element is read once, then written). Exact: every
    partial sum is a product over fewer terms, inside the same cap. Parameters (c, acc_in, acc)."""
    c = te.placeholder(c_shape, I32, name="c")
    acc_in = te.placeholder(form.out_shape, I32, name="acc_in")
    out = te.compute(form.out_shape, lambda *idx: acc_in[idx] + _c_at(form, c, idx), name="acc")
    return _func([c, acc_in, out], name)


def form_of(product: str, args: tuple, name: str) -> GemmForm:
    """The GEMM form of a te_products builder (`conv2d_acc`, ..., `linear_grad_weight_acc`)
    called with the same geometry arguments."""
    if product.startswith("conv2d"):
        geom = ConvGeom.of(*args)
        conv = {
            "conv2d_acc": conv_forward,
            "conv2d_grad_input_acc": conv_grad_input,
            "conv2d_grad_weight_acc": conv_grad_weight,
        }
        return conv[product](name, geom)
    linear = {
        "linear_acc": linear_forward,
        "linear_grad_input_acc": linear_grad_input,
        "linear_grad_weight_acc": linear_grad_weight,
    }
    if product not in linear:
        raise ValueError(f"unknown product {product!r}")
    return linear[product](name, *args)
