"""Non-product ops of the training step as TVM tensor expressions (target independent).

The GPU (and later the TVM CPU) backend lowers every op of the step from one TE definition; the
tests build the same PrimFuncs for llvm and compare them with `mexc.kernels` bit for bit, so the
CUDA build of the TIR is checked on a machine without a GPU. Ops whose result may need rounding
produce an int32 accumulator for `te_compaction` (compaction with shift 0 is the identity on
values within qmax, which is how the reference's "compact only if it exceeds qmax" comes out).

So far: ReLU forward/backward, max pooling forward (value and first-maximum offset) and
backward, the aligned sum of residual adds and gradient sums, and the softmax cross-entropy head
(probabilities forward, gradient backward; its run-time divisions are `te_divide`'s integer long
division, since nvcc would divide with a float reciprocal). The remaining ops of docs/layers.md
are listed in docs/cuda.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tvm import te, tirx

from mexc.kernels.elementwise import DIV_BITS
from mexc.kernels.loss import (
    LOSS_GAP_EXP,
    LOSS_GAP_SHIFT_MAX,
    PROB_BITS,
    PROB_DTYPE,
    PROB_ONE,
)
from mexc.lowering.te_compaction import (
    _flat_index,
    aligned_target,
    fused_compaction,
    shift_left_saturating,
    shift_right32,
    shift_signed,
    shift_signed32,
    where,
)
from mexc.lowering.te_divide import idiv_round
from mexc.lowering.te_func import a_row_at_a_time, prim_func
from mexc.lowering.te_products import IntPair, _pair
from mexc.numerics import EXP_IN_EXP

I8, I32, I64 = "int8", "int32", "int64"
PAD = -(1 << 14)  # below every int8 mantissa: padding never wins a max


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    # run-time divisions become integer long divisions (nvcc would use a float reciprocal)
    return prim_func(args, name)


def relu_forward(shape: tuple[int, ...], name: str = "relu_forward") -> tirx.PrimFunc:
    """y = max(m, 0); the exponent passes through unchanged (kernels.relu_forward)."""
    x = te.placeholder(shape, I8, name="x")
    y = te.compute(shape, lambda *i: tirx.max(x[i], tirx.const(0, I8)), name="y")
    return _func([x, y], name)


def relu_backward(shape: tuple[int, ...], name: str = "relu_backward") -> tirx.PrimFunc:
    """dx = dy where x > 0 else 0 (kernels.relu_backward with the ReLU input or output)."""
    dy = te.placeholder(shape, I8, name="dy")
    x = te.placeholder(shape, I8, name="x")
    dx = te.compute(shape, lambda *i: where(x[i] > 0, dy[i], tirx.const(0, I8)), name="dx")
    return _func([dy, x, dx], name)


def _pool_geometry(
    x_shape: tuple[int, int, int, int],
    kernel: IntPair,
    stride: IntPair | None,
    padding: IntPair,
    extra: IntPair = 0,
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int, int, int]]:
    """(kernel, stride, padding, output shape); `extra` pads the bottom and right only
    (ceil_mode windows)."""
    k = _pair(kernel)
    s = _pair(stride if stride is not None else kernel)
    p = _pair(padding)
    ex = _pair(extra)
    n, c, h, w = x_shape
    oh = (h + 2 * p[0] + ex[0] - k[0]) // s[0] + 1
    ow = (w + 2 * p[1] + ex[1] - k[1]) // s[1] + 1
    return k, s, p, (n, c, oh, ow)


def maxpool_forward(
    x_shape: tuple[int, int, int, int],
    kernel: IntPair,
    stride: IntPair | None = None,
    padding: IntPair = 0,
    name: str = "maxpool_forward",
    arg_dtype: str = I32,
    extra: IntPair = 0,
) -> tirx.PrimFunc:
    """y = window max; arg = offset i*KW + j of the first maximum in row-major window order
    (kernels.maxpool2d_forward), stored as `arg_dtype` (int8 holds windows of up to 127
    taps). `extra`: ceil_mode's padding at the bottom and right. Parameters (x, y, arg)."""
    k, s, p, y_shape = _pool_geometry(x_shape, kernel, stride, padding, extra)
    _, _, h, w = x_shape
    x = te.placeholder(x_shape, I8, name="x")

    def tap(o: tuple, i: tirx.Var, j: tirx.Var, pad: int = PAD) -> tirx.PrimExpr:
        n, c, oy, ox = o
        iy, ix = oy * s[0] + i - p[0], ox * s[1] + j - p[1]
        ok = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        safe_y = tirx.if_then_else(ok, iy, 0)
        safe_x = tirx.if_then_else(ok, ix, 0)
        return where(ok, x[n, c, safe_y, safe_x].astype(I32), tirx.const(pad, I32))

    ri = te.reduce_axis((0, k[0]), "ri")
    rj = te.reduce_axis((0, k[1]), "rj")
    # y straight in int8 (padding as -128): every window holds an input pixel (torch's pooling
    # geometry), so the max is the input's; an int32 max in between was a batch-sized
    # workspace TVM allocates outside the arena
    y = te.compute(
        y_shape,
        lambda *o: te.max(tap(o, ri, rj, pad=-128).astype(I8), axis=[ri, rj]),
        name="y",
    )
    qi = te.reduce_axis((0, k[0]), "qi")
    qj = te.reduce_axis((0, k[1]), "qj")
    none = tirx.const(k[0] * k[1], arg_dtype)
    arg = te.compute(
        y_shape,
        lambda *o: te.min(
            tirx.if_then_else(
                tap(o, qi, qj) == y[o].astype(I32), (qi * k[1] + qj).astype(arg_dtype), none
            ),
            axis=[qi, qj],
        ),
        name="arg",
    )
    return _func([x, y, arg], name)


def window_through(
    yy: tirx.PrimExpr,
    xx: tirx.PrimExpr,
    ri: tirx.PrimExpr,
    rj: tirx.PrimExpr,
    s: tuple[int, int],
    p: tuple[int, int],
    out_hw: tuple[int, int],
) -> tuple[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr]:
    """The pooling window (oy, ox) that covers input pixel (yy, xx) through tap (ri, rj)
    (oy*s + ri - p == yy), clamped to (0, 0) when there is none, and whether there is one: the
    gather form of a pooling backward scatter."""
    ty, tx = yy + p[0] - ri, xx + p[1] - rj
    oy, ox = tirx.floordiv(ty, s[0]), tirx.floordiv(tx, s[1])
    ok = tirx.all(
        ty >= 0,
        tx >= 0,
        tirx.floormod(ty, s[0]) == 0,
        tirx.floormod(tx, s[1]) == 0,
        oy < out_hw[0],
        ox < out_hw[1],
    )
    return tirx.if_then_else(ok, oy, 0), tirx.if_then_else(ok, ox, 0), ok


def maxpool_backward_acc(
    x_shape: tuple[int, int, int, int],
    kernel: IntPair,
    stride: IntPair | None = None,
    padding: IntPair = 0,
    name: str = "maxpool_backward_acc",
    arg_dtype: str = I32,
    out_dtype: str = I32,
    extra: IntPair = 0,
) -> tirx.PrimFunc:
    """acc[n,c,y,x] = sum of dy over the windows whose first maximum sits at (y, x), written as a
    gather (each input pixel visits the windows that contain it). Parameters (dy, arg, acc).
    out_dtype int8: only where windows tile the input (`tiles`), where every acc is one dy or
    0, so that its compaction is the identity (shift 0) and dx is acc itself. `extra`:
    ceil_mode's padding at the bottom and right."""
    k, s, p, y_shape = _pool_geometry(x_shape, kernel, stride, padding, extra)
    _, _, oh, ow = y_shape
    dy = te.placeholder(y_shape, I8, name="dy")
    arg = te.placeholder(y_shape, arg_dtype, name="arg")
    if tiles(x_shape, kernel, stride, padding):  # each pixel is in at most one window
        return _maxpool_backward_tiled(x_shape, k, y_shape, dy, arg, name, out_dtype)
    if out_dtype != I32:
        raise ValueError("overlapping windows sum gradients: their accumulator is int32")
    ri = te.reduce_axis((0, k[0]), "ri")
    rj = te.reduce_axis((0, k[1]), "rj")

    def body(n, c, yy, xx):
        sy, sx, ok = window_through(yy, xx, ri, rj, s, p, (oh, ow))
        hit = tirx.all(ok, arg[n, c, sy, sx].astype(I32) == ri * k[1] + rj)
        return te.sum(
            where(hit, dy[n, c, sy, sx].astype(I32), tirx.const(0, I32)),
            axis=[ri, rj],
        )

    acc = te.compute(x_shape, body, name="acc")
    return _func([dy, arg, acc], name)


def _maxpool_backward_tiled(
    x_shape: tuple[int, int, int, int],
    k: tuple[int, int],
    y_shape: tuple[int, int, int, int],
    dy: te.Tensor,
    arg: te.Tensor,
    name: str,
    out_dtype: str = I32,
) -> tirx.PrimFunc:
    """maxpool_backward_acc for non-overlapping windows: a gather with no reduction."""
    _, _, oh, ow = y_shape

    def body(n, c, yy, xx):
        oy, ox = yy // k[0], xx // k[1]
        inside = tirx.all(oy < oh, ox < ow)
        sy, sx = tirx.min(oy, oh - 1), tirx.min(ox, ow - 1)
        hit = tirx.all(inside, arg[n, c, sy, sx].astype(I32) == (yy % k[0]) * k[1] + xx % k[1])
        return where(hit, dy[n, c, sy, sx].astype(I32), tirx.const(0, I32)).astype(out_dtype)

    acc = te.compute(x_shape, body, name="acc")
    return _func([dy, arg, acc], name)


def tiles(
    x_shape: tuple[int, int, int, int],
    kernel: IntPair,
    stride: IntPair | None = None,
    padding: IntPair = 0,
) -> bool:
    """Whether pooling windows tile the input: every pixel in at most one window."""
    k, s, p, _ = _pool_geometry(x_shape, kernel, stride, padding)
    return k == s and p == (0, 0)


def aligned_sum_acc(
    shape: tuple[int, ...],
    terms: int,
    stochastic: bool,
    name: str = "aligned_sum",
    exponent_buffers: bool = False,
) -> tirx.PrimFunc:
    """Sum of `terms` int8 tensors with per-tensor exponents (kernels.grad_sum / add_forward
    before their compaction): target = max(min e_i, max(e_i + 7) + c - 31), c = bit_length(T);
    term i shifted by target - e_i with rounding key i. Parameters (m_0 .. m_{T-1}, e, keys,
    target, acc): e int32[T], keys int64[T] (the uint32 site keys), target int32[1]; with
    `exponent_buffers` e is T one-element buffers e_0 .. e_{T-1} (each term's own)."""
    inputs, target, value = _aligned_sum_terms(shape, terms, stochastic, exponent_buffers)
    acc = te.compute(shape, value, name="acc")
    return _func([*inputs, target, acc], name)


def acc_sum_target(es: list[te.Tensor], amaxes: list[te.Tensor], name: str = "target") -> te.Tensor:
    """kernels.param_grad_sum's exponent (docs/numerics.md section 7c) from each term's
    exponent e_i (1,) and largest magnitude amax_i (element 0): b_i = bit_length(amax_i),
    target = max(min e_i, max(e_i + b_i) + c - 31) over the terms that are not all zero, the
    lowest e_i where every term is zero."""
    none, big = tirx.const(0, I32), tirx.const(1 << 30, I32)
    c = len(es).bit_length()

    def bit_length(v: tirx.PrimExpr) -> tirx.PrimExpr:
        total: tirx.PrimExpr = none
        for t in range(31):  # |int32 accumulator| < 2^31
            total = total + where(v >= (1 << t), tirx.const(1, I32), none)
        return total

    def value(_: tirx.PrimExpr) -> tirx.PrimExpr:
        low, top, lowest = big, -big, es[0][0]
        for e, a in zip(es, amaxes):
            live = a[0] > 0
            low = tirx.min(low, where(live, e[0], big))
            top = tirx.max(top, where(live, e[0] + bit_length(a[0]), -big))
            lowest = tirx.min(lowest, e[0])
        return where(low < big, tirx.max(low, top + (c - 31)), lowest)

    return te.compute((1,), value, name=name)


def aligned_acc_sum(
    shape: tuple[int, ...], terms: int, stochastic: bool, name: str, slot: int = 1
) -> tirx.PrimFunc:
    """kernels.param_grad_sum: `terms` int32 accumulators at their exponents added as an
    aligned sum, each term bounded by its largest magnitude (`acc_sum_target`). A term is
    shifted left by at most 31 - c - 1 bits (exact: it stays below 2^(31 - c)) or right with
    rounding key i; an all-zero term adds zero whatever its shift (zero shifted either way is
    zero).
    Parameters (a_0 .. a_{T-1}, e_0 .. e_{T-1}, amax_0 .. amax_{T-1}, keys, target, acc): e_i
    one-element buffers, amax_i the term's max |a_i| in element 0 of `slot`, keys int64[T]."""
    accs = [te.placeholder(shape, I32, name=f"a{i}") for i in range(terms)]
    es = [te.placeholder((1,), I32, name=f"e{i}") for i in range(terms)]
    amaxes = [te.placeholder((slot,), I32, name=f"amax{i}") for i in range(terms)]
    keys = te.placeholder((terms,), "int64", name="keys")
    target = acc_sum_target(es, amaxes)
    left_limit = 31 - terms.bit_length() - 1

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, idx)
        total: tirx.PrimExpr = tirx.const(0, I32)
        for i in range(terms):
            total = total + shift_signed32(
                accs[i][idx], target[0] - es[i][0], keys[i], flat, stochastic, left_limit
            )
        return total

    acc = te.compute(shape, body, name="acc")
    return _func([*accs, *es, *amaxes, keys, target, acc], name)


def aligned_sum_compaction(
    shape: tuple[int, ...],
    terms: int,
    bits: int,
    stochastic: bool,
    name: str = "aligned_sum",
    agreed: int = 0,
) -> tuple[tirx.PrimFunc, ...]:
    """aligned_sum_acc (exponent_buffers) compacted without storing the sum
    (te_compaction.fused_compaction, `agreed` its data-parallel form): `<name>_shift` (m_0 ..
    m_{T-1}, e_0 .. e_{T-1}, keys, s, e_out) and `<name>_apply` (the same inputs, s, key, m)."""
    inputs, target, value = _aligned_sum_terms(shape, terms, stochastic, True)
    return fused_compaction(shape, inputs, target, value, bits, stochastic, name, agreed)


def concat_compaction(
    outer: int,
    sizes: tuple[int, ...],
    inner: int,
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.elementwise.concat_forward compacted without storing the aligned int32 tensor:
    the inputs seen as (outer, sizes[i], inner) (2-D when inner is 1), the output as (outer,
    sum(sizes), inner). Parameters of both kernels: m_0 .. m_{T-1}, e_0 .. e_{T-1}, key (site 0),
    then fused_compaction's. Memoized: building one for many inputs takes about a second
    (DenseNet-121 has 58, and the launch plan is built once per lean trial). `agreed`:
    fused_compaction's data-parallel form (`<name>_amax` first)."""
    kernels = _concat_kernels(outer, tuple(sizes), inner, bits, stochastic, agreed)
    return tuple(
        k.with_attr("global_symbol", f"{name}_{str(k.attrs['global_symbol']).split('_')[-1]}")
        for k in kernels
    )


@functools.lru_cache(maxsize=256)
def _concat_kernels(
    outer: int, sizes: tuple[int, ...], inner: int, bits: int, stochastic: bool, agreed: int
) -> tuple[tirx.PrimFunc, ...]:
    name = "concat"
    tail = (inner,) if inner > 1 else ()
    ms = [te.placeholder((outer, k, *tail), I8, name=f"m{i}") for i, k in enumerate(sizes)]
    es = [te.placeholder((1,), I32, name=f"e{i}") for i in range(len(sizes))]
    key = te.placeholder((1,), I64, name="align_key")  # "key" is the compaction's
    lo = es[0][0]
    hi = es[0][0]
    for e in es[1:]:
        lo, hi = tirx.min(lo, e[0]), tirx.max(hi, e[0])
    target = te.compute((1,), lambda _: tirx.max(lo, hi + (7 - 31)), name="target")
    shape = (outer, sum(sizes), *tail)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        c = idx[1]
        x: tirx.PrimExpr = tirx.const(0, I32)
        e: tirx.PrimExpr = tirx.const(0, I32)
        # the element's mantissa and exponent, as an OR of the inputs' values masked by which
        # input holds it (exclusive cases: a chain of `where`s would double per input), with
        # indices clamped into each input so that no load is out of bounds; then one shift
        # and one rounding hash per element
        for i in range(len(sizes)):
            local = tirx.min(tirx.max(c - starts[i], 0), sizes[i] - 1)
            xi = ms[i][(idx[0], local, *idx[2:])].astype(I32)
            # -1 where starts[i] <= c < its end, else 0, in int32 arithmetic: a bool cast
            # vectorized along c (inner 1: c is the last axis) fails in TVM's simplifier
            gap = (c - starts[i]) | (starts[i] + sizes[i] - 1 - c)
            mask = ~(gap.astype(I32) >> 31)
            x, e = x | (xi & mask), e | (es[i][0] & mask)
        return shift_signed32(x, target[0] - e, key[0], _flat_index(shape, idx), stochastic, 24)

    return fused_compaction(shape, [*ms, *es, key], target, body, bits, stochastic, name, agreed)


def _aligned_sum_terms(
    shape: tuple[int, ...], terms: int, stochastic: bool, exponent_buffers: bool
) -> tuple[list[te.Tensor], te.Tensor, Callable[..., tirx.PrimExpr]]:
    """aligned_sum_acc's inputs, target exponent and element."""
    if terms < 2:
        raise ValueError("aligned_sum_acc needs at least two terms")
    ms = [te.placeholder(shape, I8, name=f"m{i}") for i in range(terms)]
    if exponent_buffers:
        e_args = [te.placeholder((1,), I32, name=f"e{i}") for i in range(terms)]
        exps = [e[0] for e in e_args]
    else:
        e_args = [te.placeholder((terms,), I32, name="e")]
        exps = [e_args[0][i] for i in range(terms)]
    keys = te.placeholder((terms,), "int64", name="keys")
    target = te.compute((1,), lambda _: aligned_target([(e, 7) for e in exps]), name="target")

    # int32 lanes: the target is at least max(e_i) + 7 + c - 31 (c = bit_length(T)), so every
    # left shift is at most 24 - c bits, a term below 2^(31 - c) and the sum of T < 2^c terms
    # inside int32 (the int64 form took twice the vectors)
    left_limit = 24 - terms.bit_length()

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, idx)
        total: tirx.PrimExpr = tirx.const(0, I32)
        for i in range(terms):
            t = target[0] - exps[i]
            x = ms[i][idx].astype(I32)
            total = total + shift_signed32(x, t, keys[i], flat, stochastic, left_limit)
        return total

    return [*ms, *e_args, keys], target, body


def table_lookup(
    table: te.Tensor,
    in_exp: int,
    m: tirx.PrimExpr,
    e: tirx.PrimExpr,
    key: tirx.PrimExpr,
    flat: tirx.PrimExpr,
    stochastic: bool,
    sign_exact: bool = False,
) -> tirx.PrimExpr:
    """numerics.LookupTable.lookup of one int64 value m at the run-time exponent e (int64): the
    index is m shifted by in_exp - e (a right shift rounded with `key` at flat index `flat`, or
    a left shift saturating at 2^30), clamped to [-128, 127] (at least 1 for m > 0 when
    sign_exact); returns table[index + 128] (the table's dtype). docs/numerics.md §9; the GELU
    tables and the exp table share it."""
    s = tirx.const(in_exp, "int64") - e
    right = shift_signed(m, s, key, flat, stochastic)
    left = shift_left_saturating(m, -s)
    idx = tirx.max(tirx.min(tirx.if_then_else(s >= 0, right, left), 127), -128)
    if sign_exact:
        idx = tirx.if_then_else(m > 0, tirx.max(idx, 1), idx)
    return table[(idx + 128).astype(I32)]


def table_lookup32(
    table: te.Tensor,
    in_exp: int,
    m: tirx.PrimExpr,
    e: tirx.PrimExpr,
    key: tirx.PrimExpr,
    flat: tirx.PrimExpr,
    stochastic: bool,
    flush: bool = False,
) -> tirx.PrimExpr:
    """`table_lookup` of an int32 m with |m| < 2^9 (an int8 mantissa, or the difference of two),
    in int32 lanes: a right shift of 32 or more gives 0, as any longer one does, and a nonzero
    m shifted left by 8 is past the clamp already, as it is when shifted further (|m| << 54 <
    2^63: the reference's saturation never wraps here). The row softmax's exp (2-core Zen 3,
    2026-12-02, 9408 x 49): 1.17 -> 0.30-0.38 ms. GELU keeps the int64 lookup: its value is int64
    arithmetic, and an int32 lookup inside it took twice as long."""
    s64 = tirx.const(in_exp, "int64") - e
    s = tirx.max(tirx.min(s64, tirx.const(32, "int64")), tirx.const(-32, "int64")).astype(I32)
    right = shift_right32(m, tirx.max(s, 0), key, flat, stochastic)
    left = m << tirx.min(tirx.max(-s, 0), 8)
    raw = where(s >= 0, right, left)
    value = table[tirx.max(tirx.min(raw, 127), -128) + 128]
    # flush (numerics.Table.lookup): 0 below the table
    return where(raw < -128, tirx.const(0, I32), value) if flush else value


def exp_lookup(
    x: te.Tensor,
    rowmax: te.Tensor,
    e: te.Tensor,
    key: tirx.PrimExpr,
    table: te.Tensor,
    stochastic: bool,
    r: tirx.PrimExpr,
    j: tirx.PrimExpr,
    flush: bool = False,
) -> tirx.PrimExpr:
    """EXP_TABLE of x[r, j] - rowmax[r] at x's exponent e[0], rounded at the flat index r K + j
    (int32); the softmax head (`flush`: 0 below the table) and the row softmax share it."""
    i64 = "int64"
    d = x[r, j].astype(I32) - rowmax[r].astype(I32)  # int8 - int8 would wrap
    flat = r.astype(i64) * int(x.shape[1]) + j.astype(i64)
    return table_lookup32(table, EXP_IN_EXP, d, e[0].astype(i64), key, flat, stochastic, flush)


def softmax_ce_forward(
    n: int,
    k: int,
    stochastic: bool,
    name: str = "softmax_ce_forward",
    native_division: bool = False,
    host_schedule: bool = False,
) -> tirx.PrimFunc:
    """kernels.softmax_ce_forward without the host-side loss: int16 p in [0, 2^15 - 1] (value
    p / 2^15), and kernels.loss.loss_rows, each row's [S, label gap], from which the host
    computes the logged loss.

    d = m - rowmax; index = d shifted to the exp table's exponent (rounding key site 0, flat
    index r*K + j; a left shift saturates at 2^30); E = table[index + 128], 0 below -128,
    clamped to 127; p = min(idiv_round(E << 15, sum_j E), 2^15 - 1). Parameters (logits, e,
    key, table, labels, probs, loss_rows): e int32[1] the logits' exponent, key int64[1],
    table int32[256] (numerics.EXP_TABLE), labels int32 (N,), loss_rows int32 (N, 2).
    `host_schedule`: a row at a time (te_func.a_row_at_a_time), so that a row's maximum,
    exponentials and sum are a scratch row, not whole tensors (a per-pixel loss's
    exponentials, int64 per class, were 21.5 MB of workspace at batch 128)."""
    i64 = "int64"
    logits = te.placeholder((n, k), I8, name="logits")
    e = te.placeholder((1,), I32, name="e")
    key = te.placeholder((1,), i64, name="key")
    table = te.placeholder((256,), I32, name="table")
    labels = te.placeholder((n,), I32, name="labels")
    rj = te.reduce_axis((0, k), "rj")
    rowmax = te.compute((n,), lambda r: te.max(logits[r, rj], axis=rj), name="rowmax")

    def lookup(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        return exp_lookup(logits, rowmax, e, key[0], table, stochastic, r, j, True).astype(i64)

    ex = te.compute((n, k), lookup, name="ex")
    rs = te.reduce_axis((0, k), "rs")
    srow = te.compute((n,), lambda r: te.sum(ex[r, rs], axis=rs), name="srow")
    top = tirx.const(PROB_ONE - 1, i64)
    probs = te.compute(
        (n, k),
        lambda r, j: tirx.min(
            idiv_round(ex[r, j] << PROB_BITS, srow[r], native_division), top
        ).astype(PROB_DTYPE),
        name="probs",
    )

    def row(r: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        y = tirx.max(tirx.min(labels[r], k - 1), 0)
        d = logits[r, y].astype(i64) - rowmax[r].astype(i64)
        return tirx.if_then_else(c == 0, srow[r], _label_gap(d, e[0])).astype(I32)

    rows = te.compute((n, 2), row, name="loss_rows")
    func = _func([logits, e, key, table, labels, probs, rows], name)
    return a_row_at_a_time(func, "probs", ("loss_rows",)) if host_schedule else func


def _label_gap(d: tirx.PrimExpr, e: tirx.PrimExpr) -> tirx.PrimExpr:
    """kernels.loss.label_gap: d <= 0 at exponent e moved to LOSS_GAP_EXP (int64)."""
    i64 = "int64"
    mag = -d
    s = e.astype(i64) - LOSS_GAP_EXP
    left = tirx.min(mag << tirx.max(tirx.min(s, LOSS_GAP_SHIFT_MAX), 0), (1 << 31) - 1)
    t = tirx.max(tirx.min(-s, 62), 1)
    right = (mag + (tirx.const(1, i64) << (t - 1))) >> t
    return -tirx.if_then_else(s >= 0, left, right)


def softmax_ce_backward_acc(
    n: int,
    k: int,
    name: str = "softmax_ce_backward_acc",
    native_division: bool = False,
    shift: int = 0,
    host_schedule: bool = False,
) -> tirx.PrimFunc:
    """kernels.softmax_ce_backward before its compaction: t = p - S * onehot (S the row's sum
    of p) on the first valid[0] rows (0 below), acc = idiv_round(t << shift, valid[1]) at
    exponent -15 - shift (kernels.loss.grad_shift of the whole batch's rows): valid[1]
    counts the valid rows of the whole batch (a data-parallel worker's rows are a share of
    it), valid[0] those among these rows. Parameters (probs int16 (N,K), labels int32 (N,),
    valid int32[2], acc int32 (N,K)). `host_schedule`: a row at a time, its sum a scalar."""
    i64 = "int64"
    probs = te.placeholder((n, k), PROB_DTYPE, name="probs")
    labels = te.placeholder((n,), I32, name="labels")
    valid = te.placeholder((2,), I32, name="valid")
    kk = te.reduce_axis((0, k), "kk")
    srow = te.compute((n,), lambda r: te.sum(probs[r, kk].astype(i64), axis=kk), name="psum")

    def body(r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        rows = tirx.max(tirx.min(valid[0], n), 0)
        t = probs[r, j].astype(i64) - tirx.if_then_else(labels[r] == j, srow[r], tirx.const(0, i64))
        t = tirx.if_then_else(r < rows, t, tirx.const(0, i64))
        whole = tirx.max(valid[1], 1).astype(i64)
        return idiv_round(t << shift, whole, native_division).astype(I32)

    acc = te.compute((n, k), body, name="acc")
    func = _func([probs, labels, valid, acc], name)
    return a_row_at_a_time(func, "acc") if host_schedule else func


def pre_shift(
    shape: tuple[int, ...], shift: int, stochastic: bool, name: str = "pre_shift"
) -> tirx.PrimFunc:
    """kernels._common.fit_product's operand pre-shift: m_out = shift_right(m, shift) (int8 in,
    int8 out: |m| <= 127 shrinks), rounding keyed by the C-order flat index of `shape`.
    Parameters (m, key, out)."""
    m = te.placeholder(shape, I8, name="m")
    key = te.placeholder((1,), I64, name="key")
    sh = tirx.const(shift, I32)

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        v = shift_right32(m[idx].astype(I32), sh, key[0], _flat_index(shape, idx), stochastic)
        return v.astype(I8)

    return _func([m, key, te.compute(shape, body, name="out")], name)


def exponent_sum(name: str = "exponent_sum") -> tirx.PrimFunc:
    """e = a + b on one-element int32 buffers: a product's exponent e_x + e_w, on the device so
    that the host never reads an exponent during a step."""
    a = te.placeholder((1,), I32, name="a")
    b = te.placeholder((1,), I32, name="b")
    e = te.compute((1,), lambda i: a[i] + b[i], name="e")
    return _func([a, b, e], name)


# aligned_target's bound for two terms: every aligned term is below 2^(31 - bit_length(2)), so
# accumulators of at most this many bits take bias_add_acc's int32 lanes
BIAS_LANES_BITS = 31 - (2).bit_length()


def bias_add_acc(
    shape: tuple[int, ...], axis: int, acc_bits: int, stochastic: bool, name: str = "bias_add"
) -> tirx.PrimFunc:
    """kernels.linear.add_bias: the aligned sum of an int32 product accumulator (magnitude bits
    `acc_bits`, rounding key 0, flat index in `shape`) and an int8 bias broadcast along `axis`
    (7 bits, key 1, flat index = the bias element's own index). Parameters (acc, e_acc, bias,
    e_b, keys, target, out): keys int64[2], target int32[1] the sum's exponent."""
    i64 = "int64"
    acc = te.placeholder(shape, I32, name="acc")
    e_acc = te.placeholder((1,), I32, name="e_acc")
    bias = te.placeholder((shape[axis],), I8, name="bias")
    e_b = te.placeholder((1,), I32, name="e_b")
    keys = te.placeholder((2,), i64, name="keys")
    target = te.compute(
        (1,), lambda _: aligned_target([(e_acc[0], acc_bits), (e_b[0], 7)]), name="target"
    )

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        j = idx[axis]
        flat = _flat_index(shape, idx)
        if acc_bits <= BIAS_LANES_BITS:
            # int32 lanes (half the vectors): the target bounds every term's left shift by
            # BIAS_LANES_BITS - its bits, so each stays below 2^29 and their sum in int32
            ta, tb = target[0] - e_acc[0], target[0] - e_b[0]
            left_acc, left_b = BIAS_LANES_BITS - acc_bits, BIAS_LANES_BITS - 7
            a = shift_signed32(acc[idx], ta, keys[0], flat, stochastic, left_acc)
            b = shift_signed32(bias[j].astype(I32), tb, keys[1], j.astype(i64), stochastic, left_b)
            return a + b
        ta = (target[0] - e_acc[0]).astype(i64)
        tb = (target[0] - e_b[0]).astype(i64)
        a = shift_signed(acc[idx].astype(i64), ta, keys[0], flat, stochastic)
        b = shift_signed(bias[j].astype(i64), tb, keys[1], j.astype(i64), stochastic)
        return (a + b).astype(I32)

    out = te.compute(shape, body, name="out")
    return _func([acc, e_acc, bias, e_b, keys, target, out], name)


def axis_sum(
    shape: tuple[int, ...], axes: tuple[int, ...], name: str = "axis_sum"
) -> tirx.PrimFunc:
    """kernels.bias_backward: int32 sum of int8 dy over `axes` (the bias gradient accumulator;
    its exponent is dy's). Parameters (dy, acc)."""
    dy = te.placeholder(shape, I8, name="dy")
    keep = [d for i, d in enumerate(shape) if i not in axes]
    red = {a: te.reduce_axis((0, shape[a]), f"r{a}") for a in axes}

    def body(*out_idx: tirx.PrimExpr) -> tirx.PrimExpr:
        it = iter(out_idx)
        idx = [red[a] if a in red else next(it) for a in range(len(shape))]
        return te.sum(dy[tuple(idx)].astype(I32), axis=list(red.values()))

    acc = te.compute(tuple(keep) or (1,), body, name="acc")
    return _func([dy, acc], name)


# ----------------------------------------------------------------------------- products x * g


def mul_compaction(
    shape: tuple[int, ...],
    g_axis: int | None,
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.elementwise.mul_forward compacted without storing the product: x seen as
    `shape`, the factor g as (shape[g_axis],) indexed along that axis, or (g_axis None) as
    `shape` itself. Parameters of both kernels: x, e_x, g, e_g, then fused_compaction's."""
    x = te.placeholder(shape, I8, name="x")
    g = te.placeholder(shape if g_axis is None else (shape[g_axis],), I8, name="g")
    ex, eg = te.placeholder((1,), I32, name="e_x"), te.placeholder((1,), I32, name="e_g")
    target = te.compute((1,), lambda _: ex[0] + eg[0], name="target")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        gv = g[idx] if g_axis is None else g[idx[g_axis]]
        return x[idx].astype(I32) * gv.astype(I32)

    return fused_compaction(shape, [x, ex, g, eg], target, body, bits, stochastic, name, agreed)


def div_quotient(shape: tuple[int, ...], name: str, native_division: bool) -> tirx.PrimFunc:
    """kernels.elementwise.div_forward before its compaction: a and b of `shape`, acc =
    idiv_round(sign(m_a m_b) |m_a| 2^15, |m_b|), m_a 2^16 where m_b = 0, at e_acc = e_a - e_b -
    15.
    Stored, not fused with the compaction: on CUDA the division is a long division
    (te_divide), whose steps a fused scan's cross-thread reduction cannot hold. Parameters
    (a, e_a, b, e_b, acc, e_acc)."""
    a = te.placeholder(shape, I8, name="a")
    b = te.placeholder(shape, I8, name="b")
    ea, eb = te.placeholder((1,), I32, name="e_a"), te.placeholder((1,), I32, name="e_b")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        ma, mb = a[idx].astype(I32), b[idx].astype(I32)
        num = tirx.if_then_else(ma < 0, -ma, ma) << DIV_BITS
        den = tirx.if_then_else(mb < 0, -mb, mb)
        signed = tirx.if_then_else((ma ^ mb) < 0, -num, num)  # the signs differ
        q = idiv_round(signed, tirx.max(den, 1), native_division).astype(I32)
        # a product, not a shift: a negative left shift is undefined in the CUDA C++ it becomes
        return tirx.if_then_else(den == 0, ma * (1 << (DIV_BITS + 1)), q)

    acc = te.compute(shape, body, name="acc")
    e_acc = te.compute((1,), lambda _: ea[0] - eb[0] - DIV_BITS, name="e_acc")
    return _func([a, ea, b, eb, acc, e_acc], name)


def mul_factor_grad(
    shape: tuple[int, ...], g_axis: int | None, t: int, stochastic: bool, name: str
) -> tirx.PrimFunc:
    """kernels.elementwise.mul_backward_factor before its compaction: acc = the sum of
    dy_m x_m (each shifted right by t, rounded with `key` at x's flat index) over every axis
    of `shape` but g_axis (over none where g_axis is None), at e_acc = e_dy + e_x + t.
    Parameters (dy, e_dy, x, e_x, key, acc, e_acc)."""
    dy = te.placeholder(shape, I8, name="dy")
    x = te.placeholder(shape, I8, name="x")
    ed, ex = te.placeholder((1,), I32, name="e_dy"), te.placeholder((1,), I32, name="e_x")
    key = te.placeholder((1,), I64, name="key")

    def term(idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        p = dy[idx].astype(I32) * x[idx].astype(I32)
        if t == 0:
            return p
        return shift_right32(p, tirx.const(t, I32), key[0], _flat_index(shape, idx), stochastic)

    if g_axis is None:
        acc = te.compute(shape, lambda *i: term(i), name="acc")
    else:
        red = {a: te.reduce_axis((0, d), f"r{a}") for a, d in enumerate(shape) if a != g_axis}

        def body(m: tirx.PrimExpr) -> tirx.PrimExpr:
            idx = tuple(m if a == g_axis else red[a] for a in range(len(shape)))
            return te.sum(term(idx), axis=list(red.values()))

        acc = te.compute((shape[g_axis],), body, name="acc")
    e_acc = te.compute((1,), lambda _: ed[0] + ex[0] + t, name="e_acc")
    return _func([dy, ed, x, ex, key, acc, e_acc], name)


# ----------------------------------------------------------------------------- table products


def table_product_compaction(
    shape: tuple[int, ...],
    in_exp: int,
    out_exp: int,
    factor: bool,
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
    sign_exact: bool = False,
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.activation.table_product compacted without storing the product: a times
    table(x) (factor False: table(x) alone; sign_exact: the table's LookupTable.sign_exact).
    Parameters of both kernels: (a, e_a,) x, e_x, key0 (the index rounding, site 0), table
    int32[256], then fused_compaction's (`agreed`: its data-parallel form)."""
    x = te.placeholder(shape, I8, name="x")
    ex = te.placeholder((1,), I32, name="e_x")
    key0 = te.placeholder((1,), I64, name="key0")
    table = te.placeholder((256,), I32, name="table")
    lead: list[te.Tensor] = []
    if factor:
        a, ea = te.placeholder(shape, I8, name="a"), te.placeholder((1,), I32, name="e_a")
        lead = [a, ea]
        target = te.compute((1,), lambda _: ea[0] + out_exp, name="target")
    else:
        target = te.compute((1,), lambda _: tirx.const(out_exp, I32), name="target")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, idx)
        m, e = x[idx].astype(I64), ex[0].astype(I64)
        t = table_lookup(table, in_exp, m, e, key0[0], flat, stochastic, sign_exact)
        return t * lead[0][idx].astype(I32) if factor else t

    inputs = [*lead, x, ex, key0, table]
    return fused_compaction(shape, inputs, target, body, bits, stochastic, name, agreed)
