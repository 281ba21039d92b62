"""The data movement and elementwise ops of a Vision Transformer as TIR kernels: transpose,
slice (and its gradient), scaling by a host constant, the broadcast add of a [1, ...] parameter,
the mean over tokens (and its gradient). GELU is a table product (te_ops.table_product_compaction).

The TE form of kernels.transformer (scale_*, add_broadcast_*, mean_tokens_*) and of the
reference rules of ops/tensor.py (transpose, slice): the same integer arithmetic, rounding sites
and C-order flat indices. Exponents are one-element run-time buffers, so every decision the
reference takes on an exponent is a branch-free
select in the kernel. Products of a rounded sum are compacted by te_compaction (through
fused_compaction where the value is cheap to compute twice)."""

from __future__ import annotations

import functools

from tvm import s_tir, te, tirx
from tvm.script import tirx as T

from mexc.lowering import tvmscript_stack
from mexc.lowering.te_compaction import (
    _flat_index,
    aligned_target,
    fused_compaction,
    shift_signed32,
    where,
)
from mexc.lowering.te_compaction import _i64 as _c
from mexc.lowering.te_func import prim_func
from mexc.lowering.te_pool import div_const
from mexc.numerics import Reciprocal

I8, I32, I64 = "int8", "int32", "int64"
Shape = tuple[int, ...]
Kernels = tuple[tirx.PrimFunc, ...]  # fused_compaction's (its data-parallel form: three)


def transpose(shape: Shape, perm: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """y = x.transpose(perm) as a copy (the reference's ascontiguousarray): y[o] = x[i] with
    i[perm[a]] = o[a]. Parameters (x, y)."""
    x = te.placeholder(shape, I8, name="x")
    out_shape = tuple(shape[p] for p in perm)

    def body(*o: tirx.PrimExpr) -> tirx.PrimExpr:
        idx: list[tirx.PrimExpr] = [tirx.const(0, I32)] * len(shape)
        for a, p in enumerate(perm):
            idx[p] = o[a]
        return x[tuple(idx)]

    return prim_func([x, te.compute(out_shape, body, name="y")], name)


def slice_copy(shape: Shape, dim: int, start: int, stop: int, name: str) -> tirx.PrimFunc:
    """y = x[..., start:stop, ...] along `dim` (a copy). Parameters (x, y)."""
    x = te.placeholder(shape, I8, name="x")
    out_shape = tuple(stop - start if a == dim else d for a, d in enumerate(shape))

    def body(*o: tirx.PrimExpr) -> tirx.PrimExpr:
        return x[tuple(o[a] + start if a == dim else o[a] for a in range(len(shape)))]

    return prim_func([x, te.compute(out_shape, body, name="y")], name)


def slice_grad(
    shape: Shape, dim: int, start: int, stop: int, name: str, host_schedule: bool = False
) -> tirx.PrimFunc:
    """dx (of `shape`) = dy inside [start, stop) along `dim`, 0 elsewhere. Parameters (dy, dx).
    `host_schedule`: a slice along the last axis gets that loop partitioned at start and stop
    (zeros, a copy, zeros: each part a plain vector loop). Unpartitioned, the clamped index of
    dy made every row a gather: 6272 x 144 from a 48-wide slice (the gradient of one part of
    a fused q k v, 2-core Zen 3, 2026-12-02) took 0.31 ms, partitioned 0.03-0.04 ms."""
    dy_shape = tuple(stop - start if a == dim else d for a, d in enumerate(shape))
    dy = te.placeholder(dy_shape, I8, name="dy")

    def body(*i: tirx.PrimExpr) -> tirx.PrimExpr:
        j = i[dim]
        inside = tirx.all(j >= start, j < stop)
        src = tirx.min(tirx.max(j - start, 0), stop - start - 1)
        v = dy[tuple(src if a == dim else i[a] for a in range(len(shape)))]
        return where(inside, v, tirx.const(0, I8))

    func = prim_func([dy, te.compute(shape, body, name="dx")], name)
    parts = [v for v in (start, stop - start, shape[dim] - stop) if v > 0]
    if not host_schedule or dim != len(shape) - 1 or len(parts) < 2:
        return func
    sch = s_tir.Schedule(func)
    sch.loop_partition(sch.get_loops(sch.get_sblock("dx"))[dim], [*parts[:-1], None])
    return sch.mod["main"]


def scale_compaction(
    shape: Shape, num: int, shift: int, bits: int, stochastic: bool, name: str, agreed: int = 0
) -> Kernels:
    """kernels.transformer.scale_forward: acc = m num (|.| < 2^22) at e - shift, compacted
    without being stored (fused_compaction: `<name>_shift` (x, e, s, e_out), `<name>_apply`
    (x, e, s, key, m))."""
    x = te.placeholder(shape, I8, name="x")
    e = te.placeholder((1,), I32, name="e")
    target = te.compute((1,), lambda i: e[i] - shift, name="target")

    def value(*i: tirx.PrimExpr) -> tirx.PrimExpr:
        return x[i].astype(I32) * num

    return fused_compaction(shape, [x, e], target, value, bits, stochastic, name, agreed)


def add_param_compaction(
    view: tuple[int, int, int], bits: int, stochastic: bool, name: str, agreed: int = 0
) -> Kernels:
    """kernels.transformer.add_broadcast_forward on x seen as (O, M, I) and p as (M,) (the
    parameter varies along the middle axis: (B, P, 1) for a positional embedding), over the
    rows (O, M I), p's index j // I: aligned_sum of (x, e_x, 7) (key 0, x's flat index) and
    (p, e_p, 7) (key 1, p's own flat index), compacted without being stored. Parameters of
    both kernels start (x, e_x, p, e_p, keys int64[2])."""
    outer, mid, inner = view
    rows = (outer, mid * inner)
    x = te.placeholder(rows, I8, name="x")
    e_x = te.placeholder((1,), I32, name="e_x")
    p = te.placeholder((mid,), I8, name="p")
    e_p = te.placeholder((1,), I32, name="e_p")
    keys = te.placeholder((2,), I64, name="keys")
    target = te.compute((1,), lambda _: aligned_target([(e_x[0], 7), (e_p[0], 7)]), name="target")
    # the target is at least max(e) + 7 + 2 - 31: left shifts of at most 22 bits (int32 lanes)
    left_limit = 22

    def value(b: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(rows, (b, j))
        m = j if inner == 1 else j // inner
        xa = shift_signed32(
            x[b, j].astype(I32), target[0] - e_x[0], keys[0], flat, stochastic, left_limit
        )
        pa = shift_signed32(
            p[m].astype(I32), target[0] - e_p[0], keys[1], m.astype(I64), stochastic, left_limit
        )
        return xa + pa

    inputs = [x, e_x, p, e_p, keys]
    return fused_compaction(rows, inputs, target, value, bits, stochastic, name, agreed)


def token_sum(shape: tuple[int, int, int], left: int, name: str) -> tirx.PrimFunc:
    """acc[b, d] = (sum_t x[b, t, d]) << left (kernels.transformer.mean_tokens_forward's sum,
    the exact shift of pool._divide where the sum's bound is at most 15 bits). Parameters
    (x, acc)."""
    b, t, d = shape
    x = te.placeholder(shape, I8, name="x")
    rt = te.reduce_axis((0, t), "rt")
    total = te.compute((b, d), lambda i, j: te.sum(x[i, rt, j].astype(I32), axis=rt), name="total")
    acc = te.compute((b, d), lambda i, j: total[i, j] << left, name="acc")
    return prim_func([x, acc], name)


def mean_tokens_grad_acc(shape: tuple[int, int, int], name: str) -> tirx.PrimFunc:
    """acc[b, t, d] = div_const(dy[b, d] << 8, T) at e_dy - 8 - pow2 (exact; the reference's
    broadcast of g over the tokens). Parameters (dy, e_dy, acc, e_acc)."""
    b, t, d = shape
    recip = Reciprocal.of(t)
    dy = te.placeholder((b, d), I8, name="dy")
    e_dy = te.placeholder((1,), I32, name="e_dy")

    def body(i: tirx.PrimExpr, _: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        return div_const(dy[i, j].astype(I64) << _c(8), recip).astype(I32)

    acc = te.compute(shape, body, name="acc")
    e_acc = te.compute((1,), lambda i: e_dy[i] - 8 - recip.pow2, name="e_acc")
    return prim_func([dy, e_dy, acc, e_acc], name)


def repeat_rows(rows: Shape, name: str) -> tirx.PrimFunc:
    """y[b, j] = p[j]: a [1, ...] parameter repeated over the batch. Parameters (p, y)."""
    p = te.placeholder((rows[1],), I8, name="p")
    y = te.compute(rows, lambda b, j: p[j], name="y")
    return prim_func([p, y], name)


def gather_rows(batch: int, period: int, sample: int, size: int, name: str) -> tirx.PrimFunc:
    """y[b, j] = p[index[(b % period) * sample + j]]: a parameter read through an index map
    over the batch (kernels.transformer.gather_param_forward). Parameters (p, index, y)."""
    p = te.placeholder((size,), I8, name="p")
    index = te.placeholder((period * sample,), I32, name="index")
    y = te.compute(
        (batch, sample), lambda b, j: p[index[tirx.indexmod(b, period) * sample + j]], name="y"
    )
    return prim_func([p, index, y], name)


def scatter_sum(rows: int, size: int, most: int, name: str) -> tirx.PrimFunc:
    """acc[k] = the sum of s[order[r]] for r in [starts[k], starts[k + 1]): the int32 row sums
    s of a gathered parameter's gradient added per source element (kernels.transformer.
    gather_param_grad), `order` listing the rows by the element they read, at most `most` per
    element. Parameters (s, order, starts, acc)."""
    s = te.placeholder((rows,), I32, name="s")
    order = te.placeholder((max(rows, 1),), I32, name="order")
    starts = te.placeholder((size + 1,), I32, name="starts")
    r = te.reduce_axis((0, most), "r")

    def body(k: tirx.PrimExpr) -> tirx.PrimExpr:
        at = starts[k] + r
        inside = at < starts[k + 1]
        row = order[tirx.Select(inside, at, 0)]
        return te.sum(tirx.Select(inside, s[row], tirx.const(0, I32)), axis=r)

    acc = te.compute((size,), body, name="acc")
    return prim_func([s, order, starts, acc], name)


def embedding_rows(rows: int, vocab: int, dim: int, name: str) -> tirx.PrimFunc:
    """y[r, :] = w[ids[r], :]: rows of an embedding table looked up by the integer input
    (kernels.transformer.embedding_forward; the host checked every id against the table).
    Parameters (w, ids, y)."""
    w = te.placeholder((vocab, dim), I8, name="w")
    ids = te.placeholder((rows,), I32, name="ids")
    y = te.compute((rows, dim), lambda r, d: w[ids[r], d], name="y")
    return prim_func([w, ids, y], name)


@functools.cache
def _embedding_scatter() -> tirx.PrimFunc:
    """A column of the table's gradient per block iteration: each zeroes its column, then adds
    the rows of dy in order (a scatter has no TE form; a sum over the rows for every table row
    would read dy once per id). Shapes and padding_idx are bound by embedding_scatter. Parsed
    on first use: TVMScript's parser would cost every compile ~15 ms at import."""
    tvmscript_stack.install()

    @T.prim_func(s_tir=True)
    def scatter(dy_h: T.handle, ids_h: T.handle, acc_h: T.handle, pad: T.int32) -> None:
        rows = T.int32()
        vocab = T.int32()
        dim = T.int32()
        dy = T.match_buffer(dy_h, (rows, dim), "int8")
        ids = T.match_buffer(ids_h, (rows,), "int32")
        acc = T.match_buffer(acc_h, (vocab, dim), "int32")
        for d in T.serial(dim):
            with T.sblock("acc"):
                vd = T.axis.spatial(dim, d)
                T.reads(dy[0:rows, vd], ids[0:rows])
                T.writes(acc[0:vocab, vd])
                for k in T.serial(vocab):
                    acc[k, vd] = 0
                for r in T.serial(rows):
                    if ids[r] != pad:
                        acc[ids[r], vd] = acc[ids[r], vd] + T.cast(dy[r, vd], "int32")

    return scatter


def embedding_scatter(
    rows: int, vocab: int, dim: int, padding_idx: int, name: str
) -> tirx.PrimFunc:
    """acc[k, :] = the int32 sum of dy[r, :] over the rows r with ids[r] = k, padding_idx's
    left out (kernels.transformer.embedding_grad): one column of the table per iteration of
    the block's spatial loop, so a parallel or thread schedule of that loop never has two
    writers of an element. Parameters (dy, ids, acc)."""
    template = _embedding_scatter()
    dy, ids, acc, pad = template.params
    func = template.specialize(
        {
            dy: tirx.decl_buffer((rows, dim), I8, "dy"),
            ids: tirx.decl_buffer((rows,), I32, "ids"),
            acc: tirx.decl_buffer((vocab, dim), I32, "acc"),
            pad: tirx.const(padding_idx, I32),
        }
    )
    return func.with_attr("global_symbol", name)


__all__ = [
    "embedding_rows",
    "embedding_scatter",
    "gather_rows",
    "scatter_sum",
    "repeat_rows",
    "add_param_compaction",
    "mean_tokens_grad_acc",
    "scale_compaction",
    "slice_copy",
    "slice_grad",
    "token_sum",
    "transpose",
]
