"""Integer SGD with momentum (docs/numerics.md section 12) as TIR kernels, for the GPU.

One parameter's update is a fixed sequence of kernels over named buffers (`update_kernels`), in
launch order ([n] = rounding site n of `numerics.update_keys`):

    grad_shift   s_g, e_g: per-group compaction shift of the gradient accumulator
    wd_sum       acc_wd = aligned sum of g (compacted on the fly [0]) [1] and w * wd [2]
    wd_shift     s_wd, e_wd: its compaction shift                      (both only if wd != 0)
    v_sum        acc_v = aligned sum of v * momentum [4] and g (compacted on the fly [0 or 3]) [5]
    v_shift      s_v, v_exp_out
    v_apply      v_out = compaction of acc_v [6]
    w_target     e_w: w's exponent, or the update's for an all-zero w (zero_weight_exponent)
    w_step       w_acc = w - lr * v_out aligned to w's exponent: rounded right shift [7] or
                 saturating left shift
    w_rescale    s_w, w_exp_out: the reactive rescale as one signed shift
    w_apply      w_out = saturate(shift_signed(w_acc, s_w)) [8]

The shifts reuse `te_compaction` (the per-group max reductions need the whole group before any
element is rounded, hence separate kernels); the compactions of g are fused into the sums that
read g, so g is never stored. Run-time values are small device buffers, so one compiled set
serves every step: exponents (int32), `lr` = (num, shift) int32[2] (the schedule changes it every
step), the nine site keys int64[9] (uint32 values). Static: shape, bits, grouping, rounding and
the momentum / weight-decay FixedScalars (fixed for a compiled program; wd = 0 drops two kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import te, tirx

from mexc.lowering.te_channels import channel_apply, channel_shift, row_max
from mexc.lowering.te_compaction import (
    _flat_index,
    aligned_target,
    compaction_apply,
    compaction_shift,
    iabs,
    shift_left_saturating,
    shift_signed,
)
from mexc.lowering.te_func import prim_func, trial_cached
from mexc.numerics import CONTAINER_BITS, VELOCITY_BITS, FixedScalar, qmax, weight_bound_bits

I8, I32, I64 = "int8", "int32", "int64"
KEY_VIEWS = {"key_v": 6, "key_w": 8}  # one-element views of `keys` for compaction_apply


@dataclass(frozen=True)
class UpdateSpec:
    """What a compiled update kernel set is specialized on."""

    shape: tuple[int, ...]
    bits: int
    per_group: bool  # one velocity exponent per index of axis 0 (else one per tensor)
    momentum: FixedScalar
    weight_decay: FixedScalar
    stochastic: bool
    # kernels over a (G, R) shape bound at call time (shape must then be 2-D): one compiled set
    # serves every parameter with the same grouping, as the element order is C order either way
    symbolic: bool = False
    # the whole-tensor maxima of w_target and w_rescale over each row first, then over the
    # rows (Device.rows_first_update)
    rows_first: bool = False
    # channel exponents (docs/numerics.md section 5): w's rows (G, -1) each round to their own
    # B-bit exponent inside the tensor's int8 frame (numerics.reactive_rescale's `channels`)
    channels: bool = False

    @property
    def grouped(self) -> bool:
        return self.per_group and self.shape[0] > 1

    @property
    def groups(self) -> int:
        return self.shape[0] if self.grouped else 1

    @property
    def kshape(self) -> tuple:
        """The shape the kernels are written for: `shape`, or (G, R) variables."""
        if not self.symbolic:
            return self.shape
        if len(self.shape) != 2:
            raise ValueError("symbolic update kernels need a (groups, rest) shape")
        return SYMBOLIC_SHAPE

    @property
    def kgroups(self) -> object:
        return self.kshape[0] if self.grouped else 1


SYMBOLIC_SHAPE = (tirx.Var("G", "int32"), tirx.Var("R", "int32"))


@dataclass(frozen=True)
class Kernel:
    """One launch: `args` names the update buffers in the func's parameter order; `reduce`
    marks the max-reduction kernels (scheduled like te_compaction's shift)."""

    func: tirx.PrimFunc
    args: tuple[str, ...]
    reduce: bool


def update_buffers(spec: UpdateSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every buffer the kernels name, except the views in KEY_VIEWS.
    Inputs w, w_exp, grad, grad_exp, v, v_exp, lr, keys; outputs w_out, w_exp_out, v_out,
    v_exp_out; the rest is scratch."""
    full, g, one = spec.shape, (spec.groups,), (1,)
    out = {"w": (full, I8), "w_exp": (one, I32), "grad": (full, I32), "grad_exp": (one, I32)}
    out |= {"v": (full, I8), "v_exp": (g, I32), "lr": ((2,), I32), "keys": ((9,), I64)}
    out |= {"s_g": (g, I32), "e_g": (g, I32), "t_v": (g, I32), "acc_v": (full, I32)}
    out |= {"s_v": (g, I32), "v_exp_out": (g, I32), "v_out": (full, I8), "w_acc": (full, I32)}
    out |= {"e_w": (one, I32), "s_w": (one, I32), "w_exp_out": (one, I32), "w_out": (full, I8)}
    out |= rescale_buffers(spec)
    if spec.weight_decay.num:
        out |= {"t_wd": (g, I32), "acc_wd": (full, I32), "s_wd": (g, I32), "e_wd": (g, I32)}
    return out


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


class _Ops:
    """Element helpers of one spec: group index, flat index, fused compaction, aligned term."""

    def __init__(self, spec: UpdateSpec) -> None:
        self.spec = spec
        self.q = qmax(spec.bits)

    def gi(self, idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        return idx[0] if self.spec.grouped else 0

    def flat(self, idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        return _flat_index(self.spec.kshape, idx)

    def compacted(
        self, acc: tirx.PrimExpr, s: tirx.PrimExpr, key: tirx.PrimExpr, flat: tirx.PrimExpr
    ) -> tirx.PrimExpr:
        """compaction_apply of one element: saturate(shift_right(acc, s)), int64."""
        v = shift_signed(acc.astype(I64), s.astype(I64), key, flat, self.spec.stochastic)
        return tirx.max(tirx.min(v, self.q), -self.q)

    def term(
        self, x: tirx.PrimExpr, shift: tirx.PrimExpr, key: tirx.PrimExpr, flat: tirx.PrimExpr
    ) -> tirx.PrimExpr:
        """One aligned-sum term: shift_signed(x, target - e_x) with the term's key."""
        return shift_signed(x, shift.astype(I64), key, flat, self.spec.stochastic)


def wd_sum(
    spec: UpdateSpec, name: str, sites: tuple[int, int, int] = (0, 1, 2), n_keys: int = 9
) -> tirx.PrimFunc:
    """acc_wd = g + w * wd aligned (section 12 step 2), g = compaction of grad by s_g; `sites`:
    the keys of g's compaction and of the two terms ([0], [1], [2] in SGD; AdamW's update
    reuses it for Adam's L2 step with its own sites, `n_keys` of them).
    Parameters (grad, s_g, e_g, w, w_exp, keys, t_wd, acc_wd)."""
    op, b, wd = _Ops(spec), spec.bits - 1, spec.weight_decay
    wb = weight_bound_bits(spec.bits, spec.channels)
    grad = te.placeholder(spec.kshape, I32, name="grad")
    s_g = te.placeholder((spec.kgroups,), I32, name="s_g")
    e_g = te.placeholder((spec.kgroups,), I32, name="e_g")
    w = te.placeholder(spec.kshape, I8, name="w")
    w_exp = te.placeholder((1,), I32, name="w_exp")
    keys = te.placeholder((n_keys,), I64, name="keys")
    wd_exp = w_exp[0] - wd.shift
    t = te.compute(
        (spec.kgroups,),
        lambda g: aligned_target([(e_g[g], b), (wd_exp, wb + wd.num.bit_length())]),
        name="t",
    )

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        g, flat = op.gi(idx), op.flat(idx)
        gm = op.compacted(grad[idx], s_g[g], keys[sites[0]], flat)
        g_term = op.term(gm, t[g] - e_g[g], keys[sites[1]], flat)
        wd_term = op.term(w[idx].astype(I64) * wd.num, t[g] - wd_exp, keys[sites[2]], flat)
        return (g_term + wd_term).astype(I32)

    acc = te.compute(spec.kshape, body, name="acc")
    return _func([grad, s_g, e_g, w, w_exp, keys, t, acc], name)


def v_sum(spec: UpdateSpec, g_site: int, name: str) -> tirx.PrimFunc:
    """acc_v = v * momentum + g aligned (step 3), g = compaction of g_acc by s [g_site].
    Parameters (g_acc, s, e, v, v_exp, keys, t_v, acc_v)."""
    op, b, mom = _Ops(spec), spec.bits - 1, spec.momentum
    gshape = (spec.kgroups,)
    g_acc = te.placeholder(spec.kshape, I32, name="g_acc")
    s = te.placeholder(gshape, I32, name="s")
    e = te.placeholder(gshape, I32, name="e")
    v = te.placeholder(spec.kshape, I8, name="v")
    v_exp = te.placeholder(gshape, I32, name="v_exp")
    keys = te.placeholder((9,), I64, name="keys")
    mom_bits = VELOCITY_BITS - 1 + max(mom.num.bit_length(), 1)
    t = te.compute(
        gshape, lambda g: aligned_target([(v_exp[g] - mom.shift, mom_bits), (e[g], b)]), name="t"
    )

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        g, flat = op.gi(idx), op.flat(idx)
        gm = op.compacted(g_acc[idx], s[g], keys[g_site], flat)
        v_term = op.term(v[idx].astype(I64) * mom.num, t[g] - (v_exp[g] - mom.shift), keys[4], flat)
        g_term = op.term(gm, t[g] - e[g], keys[5], flat)
        return (v_term + g_term).astype(I32)

    acc = te.compute(spec.kshape, body, name="acc")
    return _func([g_acc, s, e, v, v_exp, keys, t, acc], name)


def _step_inputs(spec: UpdateSpec) -> tuple[te.Tensor, ...]:
    """The placeholders w_target and w_step share: w, w_exp, v_out, v_exp_out, lr."""
    return (
        te.placeholder(spec.kshape, I8, name="w"),
        te.placeholder((1,), I32, name="w_exp"),
        te.placeholder(spec.kshape, I8, name="v_out"),
        te.placeholder((spec.kgroups,), I32, name="v_exp_out"),
        te.placeholder((2,), I32, name="lr"),
    )


NO_EXP = -(1 << 30)  # below every update exponent: "no group has a nonzero update"


def zero_weight_target(
    kshape: tuple,
    w: te.Tensor,
    w_exp: te.Tensor,
    u: te.Tensor,
    u_exp: Callable[[tuple[tirx.PrimExpr, ...]], tirx.PrimExpr],
    lr: te.Tensor,
    rows_first: bool = False,
) -> te.Tensor:
    """numerics.zero_weight_exponent as a (1,) tensor: w_exp, or, if every w is 0, the largest
    u_exp(idx) - lr.shift over the elements whose update u * lr.num is nonzero (none: w_exp).
    The SGD and the AdamW updates share it. `rows_first`: whole_max's."""

    def nonzero(idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        return tirx.if_then_else(w[idx] != 0, 1, 0)

    def live_exp(idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        live = tirx.all(u[idx] != 0, lr[0] != 0)
        return tirx.if_then_else(live, u_exp(idx) - lr[1], NO_EXP)

    nz = whole_max(kshape, nonzero, "w_nonzero", rows_first)
    best = whole_max(kshape, live_exp, "u_exp", rows_first)
    keep = tirx.any(nz[0] > 0, best[0] == NO_EXP)
    return te.compute((1,), lambda i: tirx.if_then_else(keep, w_exp[i], best[0]), name="e_w")


def whole_max(
    kshape: tuple,
    value: Callable[[tuple[tirx.PrimExpr, ...]], tirx.PrimExpr],
    name: str,
    rows_first: bool,
) -> te.Tensor:
    """(1,): the maximum of value(idx) over the whole of `kshape`. One serial reduction, or
    with `rows_first` one per index of axis 0, then one over those (UpdateSpec.rows_first: a
    GPU reduces the rows in parallel thread blocks). Maxima are exact in any order."""
    if not rows_first:
        axes = [te.reduce_axis((0, d), f"{name}_a{i}") for i, d in enumerate(kshape)]
        return te.compute((1,), lambda _: te.max(value(tuple(axes)), axis=axes), name=name)
    rest = [te.reduce_axis((0, d), f"{name}_r{i}") for i, d in enumerate(kshape[1:])]

    def row(g: tirx.PrimExpr) -> tirx.PrimExpr:
        return te.max(value((g, *rest)), axis=rest) if rest else value((g,))

    rows = te.compute((kshape[0],), row, name=f"{name}_rows")
    g = te.reduce_axis((0, kshape[0]), f"{name}_g")
    return te.compute((1,), lambda _: te.max(rows[g], axis=g), name=name)


def w_target(spec: UpdateSpec, name: str) -> tirx.PrimFunc:
    """e_w of step 4 (zero_weight_target), the update being v_out * lr.num at v_exp_out.
    Parameters (w, w_exp, v_out, v_exp_out, lr, e_w)."""
    op = _Ops(spec)
    w, w_exp, v, v_exp, lr = _step_inputs(spec)
    e_w = zero_weight_target(
        spec.kshape, w, w_exp, v, lambda idx: v_exp[op.gi(idx)], lr, spec.rows_first
    )
    return _func([w, w_exp, v, v_exp, lr, e_w], name)


def w_step(spec: UpdateSpec, name: str) -> tirx.PrimFunc:
    """w_acc = w - align(v_out * lr.num) (steps 4 and 5): d = w_exp - (v_exp_out - lr.shift);
    rounded right shift by d [7] when d >= 0, else left shift by -d saturating at 2^30.
    Parameters (w, w_exp, v_out, v_exp_out, lr, keys, w_acc); lr = (num, shift)."""
    op = _Ops(spec)
    w, w_exp, v, v_exp, lr = _step_inputs(spec)
    keys = te.placeholder((9,), I64, name="keys")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        u = v[idx].astype(I64) * lr[0].astype(I64)  # |u| < 2^22
        d = (w_exp[0] - (v_exp[op.gi(idx)] - lr[1])).astype(I64)
        right = shift_signed(u, tirx.max(d, 0), keys[7], op.flat(idx), spec.stochastic)
        step = tirx.if_then_else(d >= 0, right, shift_left_saturating(u, -d))
        return (w[idx].astype(I64) - step).astype(I32)

    w_acc = te.compute(spec.kshape, body, name="w_acc")
    return _func([w, w_exp, v, v_exp, lr, keys, w_acc], name)


def w_rescale(spec: UpdateSpec, name: str) -> tirx.PrimFunc:
    """numerics.reactive_rescale's shift as one signed s (step 6): M = max|w_acc|;
    s = #{t < 32 : M > q 2^t} (right, M > q) - #{1 <= t < 32 : 0 < M, M 2^t <= q} (left, the
    largest s with M 2^s <= q); 0 when M = 0. Blocks named as compaction_shift's, so its
    schedule applies. Parameters (w_acc, w_exp, s_w, w_exp_out)."""
    w_acc = te.placeholder(spec.kshape, I32, name="w_acc")
    w_exp = te.placeholder((1,), I32, name="w_exp")
    amax = whole_max(spec.kshape, lambda idx: iabs(w_acc[idx]), "amax", spec.rows_first)
    t = te.reduce_axis((0, 32), "t")
    m, tt, q = amax[0].astype(I64), t.var.astype(I64), tirx.const(qmax(spec.bits), I64)
    right = tirx.if_then_else(m > (q << tt), 1, 0)
    left = tirx.if_then_else(tirx.all(tt >= 1, m > 0, (m << tt) <= q), 1, 0)
    s = te.compute((1,), lambda _: te.sum(right - left, axis=t), name="s")
    e_out = te.compute((1,), lambda _: w_exp[0] + s[0], name="e_out")
    return _func([w_acc, w_exp, s, e_out], name)


def rows_on(spec: UpdateSpec) -> bool:
    """Whether w's rows get channel exponents (a no-op at 8 bits)."""
    return spec.channels and spec.bits < CONTAINER_BITS


def rescale_buffers(spec: UpdateSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """The row rescale's scratch (rescale_kernels) under channel exponents: the rows' maxima
    and shifts."""
    if not rows_on(spec):
        return {}
    rows = (spec.shape[0],)
    return {"amax_w": (rows, I32), "sh_w": (rows, I32), "up_w": (rows, I32)}


def rescale_kernels(spec: UpdateSpec, name: str, key: str) -> list[Kernel]:
    """numerics.reactive_rescale of w_acc (exponent e_w) into w_out, w_exp_out (steps 6-7),
    rounded with the update buffer `key`: one signed shift for the tensor, or under channel
    exponents one per row in the tensor's int8 frame (te_channels, signed)."""
    shape, bits = spec.kshape, spec.bits
    if not rows_on(spec):
        return [
            Kernel(w_rescale(spec, f"{name}_rescale"), ("w_acc", "e_w", "s_w", "w_exp_out"), True),
            Kernel(
                compaction_apply(shape, bits, False, spec.stochastic, name),
                ("w_acc", "s_w", key, "w_out"),
                reduce=False,
            ),
        ]
    rows = shape[0]
    shift = channel_shift(rows, bits, f"{name}_rows", signed=True)
    apply = channel_apply(shape, spec.stochastic, f"{name}_rows", axis=0, signed=True)
    return [
        Kernel(row_max(shape, f"{name}_rows"), ("w_acc", "amax_w"), True),
        Kernel(shift, ("amax_w", "e_w", "sh_w", "up_w", "w_exp_out"), False),
        Kernel(apply, ("w_acc", "sh_w", "up_w", key, "w_out"), False),
    ]


def compaction_kernels(
    shape: tuple,
    bits: int,
    grouped: bool,
    stochastic: bool,
    name: str,
    buffers: tuple[str, str, str, str, str, str],
) -> list[Kernel]:
    """The shift and the apply of one compaction; `buffers` = (acc, e_in, s, e_out, key,
    out), the update buffers they read and write."""
    acc, e_in, s, e_out, key, out = buffers
    return [
        Kernel(compaction_shift(shape, bits, grouped, name), (acc, e_in, s, e_out), reduce=True),
        Kernel(compaction_apply(shape, bits, grouped, stochastic, name), (acc, s, key, out), False),
    ]


def l2_kernels(
    spec: UpdateSpec,
    src: tuple[str, str, str],
    name: str,
    tag: str,
    sites: tuple[int, int, int],
    n_keys: int,
) -> tuple[list[Kernel], tuple[str, str, str]]:
    """The L2 term of the gradient, g = compact(g + w * spec.weight_decay) (section 12 step 2,
    12b step 1b): the aligned sum of g (read as `src` = (acc, s, e)) and the decay into
    acc_<tag>, and its compaction shift s_<tag>, e_<tag>; and the new `src` of g, which the
    sums after it compact on the fly (with a key of the caller's)."""
    shape, bits, grouped = spec.kshape, spec.bits, spec.grouped
    args = (*src, "w", "w_exp", "keys", f"t_{tag}", f"acc_{tag}")
    shift = compaction_shift(shape, bits, grouped, f"{name}_{tag}")
    kernels = [
        Kernel(wd_sum(spec, f"{name}_{tag}_sum", sites, n_keys), args, reduce=False),
        Kernel(shift, (f"acc_{tag}", f"t_{tag}", f"s_{tag}", f"e_{tag}"), reduce=True),
    ]
    return kernels, (f"acc_{tag}", f"s_{tag}", f"e_{tag}")


@trial_cached(lambda spec, name="sgd": (spec, name))
def update_kernels(spec: UpdateSpec, name: str = "sgd") -> list[Kernel]:
    """The kernels of one parameter's update in launch order (module docstring)."""
    shape, bits, grouped = spec.kshape, spec.bits, spec.grouped
    out = [
        Kernel(
            compaction_shift(shape, bits, grouped, f"{name}_grad", shared_exp=True),
            ("grad", "grad_exp", "s_g", "e_g"),
            reduce=True,
        )
    ]
    src = ("grad", "s_g", "e_g")
    if spec.weight_decay.num:
        wd, src = l2_kernels(spec, src, name, "wd", (0, 1, 2), 9)
        out += wd
    site = 3 if spec.weight_decay.num else 0
    v_args = (*src, "v", "v_exp", "keys", "t_v", "acc_v")
    v_buffers = ("acc_v", "t_v", "s_v", "v_exp_out", "key_v", "v_out")
    return [
        *out,
        Kernel(v_sum(spec, site, f"{name}_v_sum"), v_args, reduce=False),
        *compaction_kernels(shape, VELOCITY_BITS, grouped, spec.stochastic, f"{name}_v", v_buffers),
        Kernel(
            w_target(spec, f"{name}_w_target"),
            ("w", "w_exp", "v_out", "v_exp_out", "lr", "e_w"),
            reduce=False,
        ),
        Kernel(
            w_step(spec, f"{name}_w_step"),
            ("w", "e_w", "v_out", "v_exp_out", "lr", "keys", "w_acc"),
            reduce=False,
        ),
        *rescale_kernels(spec, f"{name}_w", "key_w"),
    ]
