"""Compaction (docs/numerics.md section 5) as TVM tensor expressions, for the GPU epilogue.

    compact(acc, e) -> (m, e + s):  s = smallest s >= 0 with max|acc| <= qmax * 2^s (per tensor
    or per group along axis 0), m = saturate(shift_right(acc, s)) with stochastic rounding keyed
    by (key, flat index) through lowbias32, or round-half-up.

Two PrimFuncs, because the shift needs a reduction over the whole tensor before any element can
be rounded: `<name>_shift` (acc, e_in -> s, e_out) and `<name>_apply` (acc, s, key -> m). The key
(the uint32 stream key held in int64) and the exponent are one-element buffers, so one compiled
kernel serves every step. Everything is int32/int64 arithmetic that TVM lowers the same way for
llvm and CUDA, so running the llvm build against `mexc.numerics.compact` checks the very TIR that
becomes the CUDA kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tvm import te, tirx

from mexc.lowering.te_func import prim_func
from mexc.numerics import CONTAINER_BITS, GOLDEN32, qmax

I32, I64, I8 = "int32", "int64", "int8"


MASK32 = 0xFFFFFFFF


def _i64(v: int) -> tirx.PrimExpr:
    return tirx.const(v, I64)


U32, U64 = "uint32", "uint64"


def _mul32(x: tirx.PrimExpr, c: int) -> tirx.PrimExpr:
    """(x * c) mod 2^32 for a uint32 x: the product of the zero-extended operands in uint64
    (below 2^64, so TVM's no-wrap flag on unsigned arithmetic is true), truncated. LLVM turns
    trunc(zext(x) * c) into a plain 32-bit multiply (`vpmulld`, 8 lanes on AVX2), one it made
    itself and so without TVM's flag: a wrapping uint32 multiply written in TIR is poison."""
    wide = x.astype(U64) * tirx.const(c, U64)
    return (wide & tirx.const(MASK32, U64)).astype(U32)  # the mask: TVM folds casts of constants


def mix32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """lowbias32 as mexc.numerics.mix32, on uint32 values.

    Shifts and xors are uint32 (no flags), multiplies go through uint64 (`_mul32`). A form with
    uint32 multiplies was miscompiled by TVM 0.27 once a run-time key entered the expression
    (39 of 60 words wrong on llvm, docs/cuda.md: TVM marks them no-wrap); the form before this
    one held the values in int64, where LLVM lost track of their zero high halves and spent
    three 64-bit multiplies on some stages (the compaction apply kernel: 2.76 -> 2.11 ms)."""
    x = _bound(x, lambda v: v ^ (v >> tirx.const(16, U32)))
    x = _bound(x, lambda v: _mul32(v, 0x7FEB352D))
    x = _bound(x, lambda v: v ^ (v >> tirx.const(15, U32)))
    x = _bound(x, lambda v: _mul32(v, 0x846CA68B))
    return _bound(x, lambda v: v ^ (v >> tirx.const(16, U32)))


def _bound(value: tirx.PrimExpr, body: Callable[[tirx.PrimExpr], tirx.PrimExpr]) -> tirx.PrimExpr:
    """body(value) with value computed once (a Let): every hash stage reads its input several
    times, and written inline the expression grows fourfold per stage (TVM's CSE leaves
    expressions with buffer loads alone, so the CUDA source of an update kernel reached 180 KB)."""
    if isinstance(value, (tirx.Var, tirx.IntImm)):
        return body(value)
    v = tirx.Var("h", _dtype(value))
    return tirx.Let(v, value, body(v))


def _dtype(e: tirx.PrimExpr) -> str:
    return str(e.dtype) if hasattr(e, "dtype") else str(e.ty)  # a TE slice or an expression


def _flat_index(shape: tuple[int, ...], idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
    """C-order flat index (int64; tensors stay below 2^31 elements)."""
    flat: tirx.PrimExpr = _i64(0)
    for extent, i in zip(shape, idx):
        ext = _i64(extent) if isinstance(extent, int) else extent.astype(I64)  # or a variable
        flat = flat * ext + i.astype(I64)
    return flat


def _u32(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """The low 32 bits of an int64 as uint32 (masked first: TVM folds casts of constants and
    rejects one out of range)."""
    return (v & _i64(MASK32)).astype(U32)


def random_word(key: tirx.PrimExpr, flat: tirx.PrimExpr) -> tirx.PrimExpr:
    """numerics.random_bits: mix32(key ^ (index * 0x9E3779B9 mod 2^32)), as int64 in [0, 2^32)
    (the key: the uint32 stream key in the low half of an int64). The key's high half is added
    to the index: a data-parallel worker's first global element of the tensor the key rounds
    (docs/numerics.md §16; the host writes it, StepPlan.key_rows), 0 in one process."""
    if _dtype(key) == I64:
        flat = flat + (key >> _i64(32))
    return mix32(_u32(key) ^ _mul32(_u32(flat), GOLDEN32)).astype(I64)


def where(cond: tirx.PrimExpr, a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """cond ? a : b with both sides evaluated, in a's integer type: b ^ ((a ^ b) & m) or
    (a & m) | (b & ~m), with m = -cond.

    `if_then_else` (and a `Select` whose sides load from buffers) becomes a branch around a
    conditional load, which LLVM cannot vectorize: a ReLU gradient took 7.9 ms for 1.6M
    elements that way and 0.13 ms branch-free. Bitwise, so no int8 or int64 arithmetic can
    overflow (TVM marks signed arithmetic no-wrap). The first form writes b twice, the second
    the condition twice; whichever of the two is smaller is written twice. A rounding's hash
    on the b side (`shift_right32`'s t >= 32 case) written twice made every rounding kernel
    twice as large for TVM's passes, LLVM and nvcc (SmallResNet's batch-norm variance kernel
    took 0.77 s to compile); a condition written twice per link of a Let chain grows with the
    chain's length once TVM substitutes the Lets (te_norm._bitlen's binary search did)."""
    dtype = _dtype(a)
    a, b = a.astype(dtype), b.astype(dtype)
    m = -(cond.astype(dtype))
    size = _nodes(cond)
    if _nodes(b, size + 1) <= size:
        return b ^ ((a ^ b) & m)
    return (a & m) | (b & ~m)


def _nodes(e: Any, cap: int = 64) -> int:
    """How many expression nodes `e` has, counted up to `cap` (a size for `where` to weigh)."""
    count = 0
    todo: list[Any] = [e]  # a worklist: expressions nest deeper than Python recurses
    while todo and count < cap:
        node = todo.pop()
        count += 1
        kind: Any = type(node)
        for field in _children(kind):
            child = getattr(node, field)
            if field in ("args", "indices"):
                todo.extend(child)
            elif child is not None:
                todo.append(child)
    return count


_CHILD_FIELDS = ("a", "b", "value", "body", "condition", "true_value", "false_value")


@functools.cache
def _children(kind: Any) -> tuple[str, ...]:
    """The fields of an expression type that hold its operands (asked once per type: reading
    absent fields of TVM objects is slow). A TE tensor's element (a Call) has its indices in
    `args`; a TensorSlice or a leaf has none."""
    if issubclass(kind, te.TensorSlice):
        return ()
    probe = [f for f in (*_CHILD_FIELDS, "args", "indices") if hasattr(kind, f)]
    return tuple(probe)


def iabs(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """|v| without a branch, v above the type's minimum: (v ^ s) - s with s = v >> (bits - 1)
    (0 or -1). Not max(v, -v): nvcc 13.0's ptxas folds max(m, max(v, -v)) for sm_90 into one
    VIMNMX3 m, v, v and drops the negation, so a GPU took the maximum of v, not of |v|
    (H200, 2026-12-04; cuda.sass_check refuses that instruction). LLVM and ptxas both
    recognize this form as an absolute value (vpabsd, IABS)."""
    dtype = _dtype(v)
    # no Let for v: TVM's bound analysis refuses a Let variable that inlining duplicates
    sign = v >> tirx.const(int(dtype.removeprefix("int")) - 1, dtype)
    return (v ^ sign) - sign


def shift_signed(
    x: tirx.PrimExpr, t: tirx.PrimExpr, key: tirx.PrimExpr, flat: tirx.PrimExpr, stochastic: bool
) -> tirx.PrimExpr:
    """numerics.shift_signed(x, t) for one element (int64): rounded right shift by t > 0
    (t >= 32 gives 0), exact left shift by -t."""
    tt = tirx.min(tirx.max(t, 0), 31)
    mask = (tirx.const(1, I64) << tt) - 1
    if stochastic:
        r = random_word(key, flat) & mask
    else:
        r = where(tt > 0, tirx.const(1, I64) << tirx.max(tt - 1, 0), tirx.const(0, I64))
    right = where(t >= 32, tirx.const(0, I64), (x >> tt) + (((x & mask) + r) >> tt))
    # both sides are computed (branch-free, so the host vectorizes the PRNG); the left shift
    # is bounded so that the unused side never shifts by 64 or more
    return where(t > 0, right, x << tirx.min(tirx.max(-t, 0), 62))


def shift_right32(
    x: tirx.PrimExpr, t: tirx.PrimExpr, key: tirx.PrimExpr, flat: tirx.PrimExpr, stochastic: bool
) -> tirx.PrimExpr:
    """numerics.shift_right(x, t) for an int32 x and a shift t >= 0 (a compaction's), in 32-bit
    lanes (`shift_signed` works in int64: twice the vectors). The split form of docs/numerics.md
    section 4 never wraps: (x & mask) + r < 2^32 in uint32, and x >> t plus a carry of 0 or 1
    stays inside int32, so TVM's no-wrap flags are true."""
    tt = tirx.min(tirx.max(t, 0), 31)
    one = tirx.const(1, I64)  # the loop-invariant mask and half in int64, then narrowed
    mask = _u32((one << tt.astype(I64)) - one)
    if stochastic:
        r = _u32(random_word(key, flat)) & mask
    else:
        r = _u32(where(tt > 0, one << tirx.max(tt - 1, 0).astype(I64), tirx.const(0, I64)))
    low = tirx.reinterpret(U32, x) & mask
    carry = ((low + r) >> _u32(tt.astype(I64))).astype(I32)
    return where(t >= 32, tirx.const(0, I32), (x >> tt) + carry)


def shift_signed32(
    x: tirx.PrimExpr,
    t: tirx.PrimExpr,
    key: tirx.PrimExpr,
    flat: tirx.PrimExpr,
    stochastic: bool,
    left_limit: int,
) -> tirx.PrimExpr:
    """numerics.shift_signed(x, t) in int32 lanes, for callers that know the exact left shift
    fits: -t <= left_limit and |x| * 2^left_limit < 2^31 (e.g. an aligned sum's terms, whose
    target exponent bounds them). The bound also keeps the unused side of the branch-free
    select from overflowing."""
    left = x << tirx.min(tirx.max(-t, 0), left_limit)
    return where(t > 0, shift_right32(x, t, key, flat, stochastic), left)


def shift_left_saturating(
    x: tirx.PrimExpr, s: tirx.PrimExpr, limit_bits: int = 30
) -> tirx.PrimExpr:
    """numerics.shift_left_saturating for one element (int64): clamp(x << min(s, 54), +-2^limit)
    with the reference's int64 wrap (|x| << 54 can exceed 2^63). The shift is done in uint64,
    where wrapping is defined in C++ too (a signed overflowing shift is undefined for nvcc), and
    reinterpreted: a Cast back to int64 would let TVM's simplifier assume a non-negative value
    and drop the lower clamp."""
    sh = tirx.max(tirx.min(s, 54), 0).astype("uint64")
    wrapped = tirx.reinterpret(I64, x.astype("uint64") << sh)
    lim = _i64(1 << limit_bits)
    return tirx.max(tirx.min(wrapped, lim), -lim)


def abs_max_rows(x: te.Tensor, name: str = "amax_rows") -> te.Tensor:
    """(shape[0],) int32: max |x| over every axis but the first, in int32 (accumulators stay
    above -2^31, so |x| does not wrap) so that the host vectorizes it and runs rows in parallel."""
    shape = tuple(x.shape)  # static extents or shape variables
    if len(shape) == 1:
        return te.compute((shape[0],), lambda r: iabs(x[r].astype(I32)), name)
    return _max_rows(shape, lambda *i: iabs(x[i].astype(I32)), name)


# block annotation of a max or sum along its contiguous last axis whose value is computed (a
# fused compaction's shift, a variance's rounded squares): the host schedule reduces it in
# vector lanes (cpu_gemm)
LANE_REDUCE = "mexc_lane_reduce"


def _max_rows(
    shape: tuple[Any, ...], value: Callable[..., tirx.PrimExpr], name: str, lanes: bool = False
) -> te.Tensor:
    """(shape[0],): max of value(*idx) (>= 0) over every axis but the first. Over the last axis
    first, into partial maxima over the leading ones, then over those: one reduction axis per
    loop nest vectorizes (an affine sum's shift over (C, S) in one nest took 3.4 ms, in two
    0.19 ms: 128 x 16 x 784, 2026-12-01). `lanes`: the last-axis reduction is marked
    LANE_REDUCE (a computed value LLVM does not vectorize as a horizontal max)."""
    last = te.reduce_axis((0, shape[-1]), f"{name}_s")
    attrs = {LANE_REDUCE: 1} if lanes else None
    if len(shape) == 2:
        return te.compute(
            (shape[0],), lambda r: te.max(value(r, last), axis=last), name=name, attrs=attrs
        )
    part = te.compute(
        shape[:-1],
        lambda *i: te.max(value(*i, last), axis=last),
        name=f"{name}_part",
        attrs=attrs,
    )
    mid = [te.reduce_axis((0, d), f"{name}_m{i}") for i, d in enumerate(shape[1:-1])]
    return te.compute((shape[0],), lambda r: te.max(part[(r, *mid)], axis=mid), name=name)


def abs_max_all(x: te.Tensor, name: str = "amax") -> te.Tensor:
    """(1,) int32: max |x| over the whole tensor, in two stages (rows in parallel, then rows)."""
    rows = abs_max_rows(x, f"{name}_rows")
    r = te.reduce_axis((0, x.shape[0]), f"{name}_r")
    return te.compute((1,), lambda _: te.max(rows[r], axis=r), name=name)


def abs_max_slot(x: te.Tensor, width: int) -> tuple[te.Tensor, te.Tensor]:
    """(max |x| as a (1,) tensor, the (width,) slot holding it in element 0 and zeros after
    it): `width` pads a slot of a buffer of maxima to 64 bytes, the alignment every kernel
    argument has. Rows along axis 0 in parallel."""
    top = abs_max_all(x, "top")
    zero = tirx.const(0, I32)
    return top, te.compute((width,), lambda i: tirx.Select(i == 0, top[0], zero), name="amax")


def abs_max_kernel(shape: tuple[int, ...], name: str, width: int = 1) -> tirx.PrimFunc:
    """amax (width,) = max |x| of an int32 tensor in element 0, zeros after it (abs_max_slot).
    Parameters (x, amax)."""
    x = te.placeholder(shape, I32, name="x")
    return prim_func([x, abs_max_slot(x, width)[1]], name)


def aligned_target(terms: list[tuple[tirx.PrimExpr, int]]) -> tirx.PrimExpr:
    """numerics.aligned_sum's target exponent for terms (exponent, static magnitude bits):
    max(min e_i, max(e_i + b_i) + bit_length(T) - 31)."""
    lo, top = terms[0][0], terms[0][0] + terms[0][1]
    for e, b in terms[1:]:
        lo, top = tirx.min(lo, e), tirx.max(top, e + b)
    return tirx.max(lo, top + (len(terms).bit_length() - 31))


def fit_shift(amax: te.Tensor, limit: int, name: str = "s") -> te.Tensor:
    """Per element of `amax` (a max |x|, int32 or int64): the smallest s >= 0 with
    amax <= limit * 2^s, as the count of t in [0, 32) with amax > limit * 2^t (monotone in t)."""
    t = te.reduce_axis((0, 32), f"{name}_t")
    over = tirx.const(limit, I64) << t.var.astype(I64)
    return te.compute(
        amax.shape,
        lambda *i: te.sum(tirx.if_then_else(amax[i].astype(I64) > over, 1, 0), axis=t),
        name=name,
    )


def compaction_shift(
    shape: tuple[int, ...], bits: int, grouped: bool, name: str, shared_exp: bool = False
) -> tirx.PrimFunc:
    """s[g] and e_out[g] = e_in[g] + s[g]; one group, or one per index of axis 0 when grouped.
    shared_exp: e_in has one element for every group (an accumulator with one exponent
    compacted per group, as the weight update does with the gradient)."""
    groups = shape[0] if grouped else 1
    acc = te.placeholder(shape, I32, name="acc")
    e_in = te.placeholder((1 if shared_exp else groups,), I32, name="e_in")
    amax = abs_max_rows(acc, "amax") if grouped else abs_max_all(acc, "amax")
    s = fit_shift(amax, qmax(bits))
    e_out = te.compute((groups,), lambda g: e_in[0 if shared_exp else g] + s[g], name="e_out")
    return prim_func([acc, e_in, s, e_out], f"{name}_shift")


# fused_compaction's `agreed` for the channel-exponent forms (PlanBuilder.compact_unstored):
# the value stored at its exponent, or scanned for its channel maxima (axis 1), then rounded
CHANNELS = -1


def fused_compaction(
    shape: tuple[int, ...],
    inputs: list[te.Tensor],
    target: te.Tensor,
    value: Callable[..., tirx.PrimExpr],
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
) -> tuple[tirx.PrimFunc, ...]:
    """The per-tensor compaction of an int32 value that is never stored: `value(*idx)` computes
    element idx from `inputs` (an elementwise producer, e.g. an aligned sum), at exponent
    target[0] (a one-element tensor computed from the inputs). Scan, then round: the shift
    kernel (inputs -> s, e_out) computes every element for max |.|, the apply kernel (inputs, s,
    key -> m) computes each again and rounds it, as compaction_shift and compaction_apply would
    on the stored accumulator, bit for bit, without its 4 bytes per element.

    `agreed`: a data-parallel worker's form, whose maximum is agreed with the other workers
    between two kernels: `<name>_amax` (inputs -> amax, a slot of `agreed` int32 holding the
    maximum in element 0), then `<name>_shift` (inputs, amax -> s, e_out), then the apply.
    agreed=CHANNELS, the channel-exponent forms (te_channels), three kernels:
    `<name>_store` (inputs -> acc, e_acc), the int32 value at its exponent; `<name>_cmax`
    (inputs -> amax (shape[1],), e_acc), its maxima along axis 1; `<name>_capply` (inputs, sh, up,
    key -> m), each channel rounded by its shift and lifted into the frame. The caller stores
    the value where axis 1 of `shape` is not the result's channel axis."""
    if agreed == CHANNELS:
        return _channel_forms(shape, inputs, target, value, stochastic, name)
    scan, slot_in, amax = unstored_abs_max(shape, inputs, value, name, agreed)
    s = fit_shift(amax, qmax(bits))
    e_out = te.compute((1,), lambda g: target[0] + s[g], name="e_out")
    shift = prim_func([*inputs, *slot_in, s, e_out], f"{name}_shift")
    s_in = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), I64, name="key")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        # the value once, bound to a name: the rounding reads it three times, and a value with
        # a keyed rounding of its own (a table product's index) written out three times left
        # the loop scalar (GELU's twelve applies in timm's ViT-Ti at batch 128: 340 ms, bound
        # 55 ms; bench/kernel_times.py, 2026-12-07)
        v = value(*idx)
        held = tirx.Var("v", _dtype(v))
        flat = _flat_index(shape, idx)
        return tirx.Let(held, v, compacted(held, s_in[0], key[0], flat, bits, stochastic))

    m = te.compute(shape, body, name="m")
    return (*scan, shift, prim_func([*inputs, s_in, key, m], f"{name}_apply"))


def _held_abs(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """|v| with v bound to a name: iabs reads its operand three times, and a value with a
    keyed rounding of its own written out three times leaves the loop scalar (GELU's twelve
    shift scans in timm's ViT-Ti at batch 128: 49 ms, bound 11 ms)."""
    held = tirx.Var("v", _dtype(v))
    return tirx.Let(held, v, iabs(held))


def unstored_abs_max(
    shape: tuple[int, ...],
    inputs: list[te.Tensor],
    value: Callable[..., tirx.PrimExpr],
    name: str,
    agreed: int = 0,
) -> tuple[list[tirx.PrimFunc], list[te.Tensor], te.Tensor]:
    """max |value(*idx)| over `shape` as a (1,) tensor, for the shift kernel of a value that is
    never stored (fused_compaction). `agreed`: a data-parallel worker's form, its maximum
    agreed between kernels: `<name>_amax` (inputs -> a slot of `agreed` int32, the maximum in
    element 0) is returned as the scan, and the shift kernel reads that slot (returned as its
    extra input). Returns (scan kernels, the shift's extra inputs, amax)."""
    if len(shape) == 1:
        rows = te.compute(shape, lambda r: _held_abs(value(r)), name="amax_rows")
    else:
        rows = _max_rows(shape, lambda *i: _held_abs(value(*i)), "amax_rows", lanes=True)
    rr = te.reduce_axis((0, shape[0]), "amax_r")
    amax = te.compute((1,), lambda _: te.max(rows[rr], axis=rr), name="amax")
    if not agreed:
        return [], [], amax
    zero = tirx.const(0, I32)
    slot = te.compute((agreed,), lambda i: tirx.Select(i == 0, amax[0], zero), name="slot")
    slot_in = te.placeholder((agreed,), I32, name="amax")
    agreed_max = te.compute((1,), lambda _: slot_in[0], name="agreed")
    return [prim_func([*inputs, slot], f"{name}_amax")], [slot_in], agreed_max


def _channel_forms(
    shape: tuple[int, ...],
    inputs: list[te.Tensor],
    target: te.Tensor,
    value: Callable[..., tirx.PrimExpr],
    stochastic: bool,
    name: str,
) -> tuple[tirx.PrimFunc, ...]:
    """fused_compaction's CHANNELS forms (store, channel maxima, channel apply)."""
    acc = te.compute(shape, lambda *i: value(*i).astype(I32), name="acc")
    e_acc = te.compute((1,), lambda g: target[0], name="e_acc")
    store = prim_func([*inputs, acc, e_acc], f"{name}_store")
    if len(shape) < 2:
        return (store,)
    # per (n, c) over the trailing axes, then per channel over n (te_norm.channel_abs_max)
    rest = [te.reduce_axis((0, d), f"rs{i}") for i, d in enumerate(shape[2:])]
    part = te.compute(
        tuple(shape[:2]),
        lambda n, c: te.max(iabs(value(n, c, *rest)), axis=rest) if rest else iabs(value(n, c)),
        name="amax_nc",
    )
    rn = te.reduce_axis((0, shape[0]), "rn")
    amax = te.compute((shape[1],), lambda c: te.max(part[rn, c], axis=rn), name="amax")
    e_max = te.compute((1,), lambda g: target[0], name="e_acc")
    cmax = prim_func([*inputs, amax, e_max], f"{name}_cmax")
    sh = te.placeholder((shape[1],), I32, name="sh")
    up = te.placeholder((shape[1],), I32, name="up")
    key = te.placeholder((1,), I64, name="key")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = _flat_index(shape, idx)
        return channel_compacted(value(*idx), sh[idx[1]], up[idx[1]], key[0], flat, stochastic)

    m = te.compute(shape, body, name="m")
    return store, cmax, prim_func([*inputs, sh, up, key, m], f"{name}_capply")


def compaction_apply(
    shape: tuple[int, ...], bits: int, grouped: bool, stochastic: bool, name: str
) -> tirx.PrimFunc:
    """m = saturate(shift_signed(acc, s[g])): the split form of numerics.shift_right for s >= 0,
    an exact left shift for s < 0 (the weight update's rescale)."""
    groups = shape[0] if grouped else 1
    acc = te.placeholder(shape, I32, name="acc")
    s_in = te.placeholder((groups,), I32, name="s")
    key = te.placeholder((1,), I64, name="key")  # the uint32 stream key, held in int64

    def body(*idx):
        s = s_in[idx[0] if grouped else 0]
        return compacted(acc[idx], s, key[0], _flat_index(shape, idx), bits, stochastic)

    m = te.compute(shape, body, name="m")
    return prim_func([acc, s_in, key, m], f"{name}_apply")


def rerounded(count: int, per: int, slot: int, bits: int, name: str) -> tirx.PrimFunc:
    """The last step of a provisional compaction (docs/numerics.md §5, "Rounding in pieces"):
    piece j of m (its `per` elements, flat indices j * per + k) was rounded stochastically by its
    own shift sj[j, 0], at most the tensor's shift s; each element is rounded again by
    d = s - sj with the bits of its word above sj: m = floor((m + ((w >> sj) & (2^d - 1))) / 2^d),
    which equals the rounding of the accumulator by s itself. d = 0 keeps m (mask 0).
    Parameters (m, sj, s, key, out); out may be m (elementwise, same index)."""
    m = te.placeholder((count, per), I8, name="m")
    sj = te.placeholder((count, slot), I32, name="sj")
    s = te.placeholder((1,), I32, name="s")
    key = te.placeholder((1,), I64, name="key")
    q = qmax(bits)

    def body(j: tirx.PrimExpr, k: tirx.PrimExpr) -> tirx.PrimExpr:
        # in 32-bit lanes, the split form of section 4: (y >> d) + carry, the carry of the
        # low d bits of y plus r in uint32 (both < 2^d <= 2^31: no wrap)
        lo = tirx.min(tirx.max(sj[j, 0], 0), 31)
        d = tirx.min(tirx.max(s[0] - lo, 0), 31)
        flat = j.astype(I64) * per + k.astype(I64)
        mask = (tirx.const(1, U32) << d.astype(U32)) - tirx.const(1, U32)
        r = (_u32(random_word(key[0], flat)) >> lo.astype(U32)) & mask
        y = m[j, k].astype(I32)
        carry = (((tirx.reinterpret(U32, y) & mask) + r) >> d.astype(U32)).astype(I32)
        return tirx.max(tirx.min((y >> d) + carry, q), -q).astype(I8)

    out = te.compute((count, per), body, name="out")
    return prim_func([m, sj, s, key, out], f"{name}_reround")


def compacted(
    x: tirx.PrimExpr,
    s: tirx.PrimExpr,
    key: tirx.PrimExpr,
    flat: tirx.PrimExpr,
    bits: int,
    stochastic: bool,
    left_limit: int = 31,
) -> tirx.PrimExpr:
    """One element of a compaction: saturate(shift_signed(x, s)) to `bits`, int8. left_limit:
    the largest left shift (-s) the caller can meet; 0 when s >= 0 wherever x is nonzero."""
    # s < 0 is the weight's reactive rescale (numerics section 12): an exact left shift that
    # keeps |x| * 2^-s <= qmax, so int32 holds it (the unused side may wrap: a plain shl)
    q = qmax(bits)
    v = shift_signed32(x, s, key, flat, stochastic, left_limit)
    return tirx.max(tirx.min(v, q), -q).astype(I8)


def channel_compacted(
    x: tirx.PrimExpr,
    sh: tirx.PrimExpr,
    up: tirx.PrimExpr,
    key: tirx.PrimExpr,
    flat: tirx.PrimExpr,
    stochastic: bool,
    left_limit: int = 0,
) -> tirx.PrimExpr:
    """One element of a channel compaction (docs/numerics.md §5): rounded by its channel's
    shift sh (signed where left_limit > 0: a weight row's exact left shift), then lifted by up
    into the tensor's int8 frame. Every channel's rounding fits qmax(B), so the int8 bound
    clips nothing, and a pass-through result (sh = up = 0: max pool's) keeps its values."""
    v = compacted(x, sh, key, flat, CONTAINER_BITS, stochastic, left_limit)
    return (v.astype(I32) << up).astype(I8)  # |v| <= qmax(B), up <= 8 - B: inside int8
