"""Channel exponents (docs/numerics.md section 5, "Channel exponents") as TVM tensor
expressions: numerics.channel_compact in three kernels, for every TIR backend.

    channel_shift  amax (C,), e (1,) or (C,) -> sh (C,), up (C,), e_out (1,)
    channel_apply  acc (A, C, S), sh, up, key -> m = saturate(round(acc >> sh_c), B) << up_c
    channel_lift   m (A, C, S) int8, up -> m << up_c (after an apply that rounds per channel
                   already: batch norm's xhat)

The maxima come from te_norm.channel_abs_max (activations: the channel is axis 1 of an
(N, C, S) view) or te_compaction.abs_max_rows (a weight's rows: a (1, G, R) view), so a
data-parallel worker can agree them between the kernels, as numerics.channel_compact's `amax`.
Everything is int32/int64 arithmetic, the same on llvm and CUDA.
"""

from __future__ import annotations

from typing import Any

from tvm import te, tirx

from mexc.lowering.te_compaction import _flat_index, abs_max_rows, channel_compacted, fit_shift
from mexc.lowering.te_func import prim_func
from mexc.numerics import CONTAINER_BITS, qmax

I8, I32, I64 = "int8", "int32", "int64"
BIG = 1 << 30  # below every exponent a program meets (|e| < 2^16)


def _signed_shift(amax: te.Tensor, bits: int, name: str) -> te.Tensor:
    """numerics.natural_shift(amax, bits, signed=True): the compaction shift (>= 0), or minus
    the largest s with 0 < amax * 2^s <= qmax (the weight's exact left shift); 0 for amax 0."""
    right = fit_shift(amax, qmax(bits), f"{name}_r")
    t = te.reduce_axis((1, 32), f"{name}_t")
    q = tirx.const(qmax(bits), I64)

    def grow(c: tirx.PrimExpr) -> tirx.PrimExpr:
        m = amax[c].astype(I64)
        fits = tirx.all(m > 0, (m << t.var.astype(I64)) <= q)
        return te.sum(tirx.if_then_else(fits, 1, 0), axis=t)

    left = te.compute(amax.shape, grow, name=f"{name}_l")
    return te.compute(amax.shape, lambda c: right[c] - left[c], name=name)


def channel_shift(
    channels: Any,
    bits: int,
    name: str,
    *,
    per_channel_exp: bool = False,
    signed: bool = False,
    passthrough: int = 0,
) -> tirx.PrimFunc:
    """numerics.channel_shifts from the channel maxima: x_c = e_c + natural_shift(amax_c),
    F = max over live channels of x_c - (8 - B), t_c = max(x_c, F); sh_c = t_c - e_c and
    up_c = t_c - F (both 0 for an all-zero channel), e_out = F. Where every channel is zero the
    plain rule's exponent: e (one exponent), max e_c (compact_common's, per-channel e).
    `passthrough`: a result whose max |.| is at most this is kept as it is (sh = up = 0,
    e_out = e; max-pool's backward, kernels.pool). Parameters (amax, e, sh, up, e_out)."""
    amax = te.placeholder((channels,), I32, name="amax")
    e = te.placeholder((channels if per_channel_exp else 1,), I32, name="e")

    def e_of(c: tirx.PrimExpr) -> tirx.PrimExpr:
        return e[c] if per_channel_exp else e[0]

    ns = _signed_shift(amax, bits, "ns") if signed else fit_shift(amax, qmax(bits), "ns")
    x = te.compute((channels,), lambda c: e_of(c) + ns[c].astype(I32), name="x")
    rc = te.reduce_axis((0, channels), "rc")
    neg = tirx.const(-BIG, I32)
    top = te.compute(
        (1,), lambda _: te.max(tirx.if_then_else(amax[rc] > 0, x[rc], neg), axis=rc), name="top"
    )
    ra = te.reduce_axis((0, channels), "ra")
    peak = te.compute((1,), lambda _: te.max(amax[ra], axis=ra), name="peak")
    if per_channel_exp:
        re = te.reduce_axis((0, channels), "re")
        rest = te.compute((1,), lambda _: te.max(e[re], axis=re), name="rest")
        idle = rest[0]
    else:
        idle = e[0]
    live = peak[0] > passthrough
    frame = te.compute(
        (1,),
        lambda _: tirx.if_then_else(live, top[0] - (CONTAINER_BITS - bits), idle),
        name="frame",
    )

    def shift(c: tirx.PrimExpr, up: bool) -> tirx.PrimExpr:
        t = tirx.max(x[c], frame[0])
        value = t - frame[0] if up else t - e_of(c)
        zero = tirx.const(0, I32)
        return tirx.if_then_else(tirx.all(live, amax[c] > 0), value, zero)

    sh = te.compute((channels,), lambda c: shift(c, False), name="sh")
    up = te.compute((channels,), lambda c: shift(c, True), name="up")
    e_out = te.compute((1,), lambda _: frame[0], name="e_out")
    return prim_func([amax, e, sh, up, e_out], f"{name}_shift")


def channel_apply(
    shape: tuple[Any, ...],
    stochastic: bool,
    name: str,
    axis: int = 1,
    signed: bool = False,
) -> tirx.PrimFunc:
    """m = saturate(shift_signed(acc, sh_c), B) << up_c for the channels c along `axis` of an
    int32 accumulator (axis 1 of an activation's (N, C, S); axis 0 of a weight's (G, R) rows),
    rounded with (key, C-order flat index). `signed`: sh may be negative (an exact left shift
    that keeps |acc| 2^-sh <= qmax: the weight's rescale). Parameters (acc, sh, up, key, m)."""
    acc = te.placeholder(shape, I32, name="acc")
    sh = te.placeholder((shape[axis],), I32, name="sh")
    up = te.placeholder((shape[axis],), I32, name="up")
    key = te.placeholder((1,), I64, name="key")
    left = 31 if signed else 0

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        c, flat = idx[axis], _flat_index(shape, idx)
        return channel_compacted(acc[idx], sh[c], up[c], key[0], flat, stochastic, left)

    m = te.compute(shape, body, name="m")
    return prim_func([acc, sh, up, key, m], f"{name}_apply")


def slot_max(count: int, slot: int, channels: int, name: str) -> tirx.PrimFunc:
    """The channel maxima of a product computed in `count` chunks: the max over the chunks'
    slots (count, slot) of each channel c < channels. Parameters (slots, amax)."""
    slots = te.placeholder((count, slot), I32, name="slots")
    r = te.reduce_axis((0, count), "r")
    amax = te.compute((channels,), lambda c: te.max(slots[r, c], axis=r), name="amax")
    return prim_func([slots, amax], f"{name}_max")


def row_max(shape: tuple[Any, ...], name: str) -> tirx.PrimFunc:
    """max |acc| per index of axis 0 (a weight's rows). Parameters (acc, amax)."""
    acc = te.placeholder(shape, I32, name="acc")
    return prim_func([acc, abs_max_rows(acc, "amax")], f"{name}_amax")


def channel_lift(shape: tuple[int, int, int], name: str) -> tirx.PrimFunc:
    """m << up_c of int8 mantissas rounded to B bits per channel (|m| <= qmax(B), so the
    result stays inside int8); elementwise, so it may run in place. Parameters (m, up, out)."""
    m = te.placeholder(shape, I8, name="m")
    up = te.placeholder((shape[1],), I32, name="up")
    out = te.compute(
        shape, lambda a, c, s: (m[a, c, s].astype(I32) << up[c]).astype(I8), name="out"
    )
    return prim_func([m, up, out], f"{name}_lift")
