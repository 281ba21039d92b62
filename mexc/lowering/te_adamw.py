"""Integer AdamW (docs/numerics.md section 12b) as TIR kernels, for the host and the GPU.

One parameter's update is a fixed sequence of kernels over named buffers (`adamw_kernels`), in
launch order ([n] = rounding site n of `numerics.adamw_keys`):

    grad_shift   s_g, e_g: per-group compaction shift of the gradient accumulator
    l2_sum       Adam's decay only: acc_l2 = g (compacted on the fly [0]) [12] + w * wd [13]
    l2_shift     s_l2, e_l2; the sums below then read g as acc_l2 compacted by s_l2 [14]
    m_sum        acc_m = aligned sum of m [1], -m * c1 [2] and g (compacted on the fly [0]) * c1 [3]
    m_shift      s_m, m_exp_out;  m_apply: m_out = compaction of acc_m [4]
    v_sum        acc_v = aligned sum of r^2 [5], -r^2 * c2 [6] and g^2 * c2 [7] (g again from [0])
    root         rho = isqrt(max(acc_v, 0) << k), rho_exp = (e_v - k) / 2
    r_shift      s_r, r_exp_out;  r_apply: r_out = compaction of rho [8]
    ratio        q = m_out / (r_out + eps) with RATIO_FRAC fraction bits, clamped
    w_target     e_w: w's exponent, or the update's for an all-zero w (zero_weight_exponent)
    w_step       w_acc = w - align(q * lr) [9] - shift_right(w * wd, wd.shift) [10]
    w_rescale    s_w, w_exp_out;  w_apply: w_out [11]

The shifts reuse `te_compaction` and the weight's rescale `te_update`, as the SGD update does.
Run-time values are small buffers, so one compiled set serves every step: exponents (int32),
`lr` = the step's (lr_t, eps_t, wd_t) as (num, shift) pairs, int32[6], and the ADAMW_SITES site
keys. Static: shape, bits, grouping, rounding, the FixedScalars of 1 - beta and Adam's L2 decay.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import te, tirx

from mexc.lowering.te_compaction import (
    aligned_target,
    compaction_shift,
    shift_left_saturating,
    shift_signed,
)
from mexc.lowering.te_divide import idiv_round, isqrt
from mexc.lowering.te_func import prim_func, trial_cached
from mexc.lowering.te_update import (
    Kernel,
    UpdateSpec,
    _Ops,
    compaction_kernels,
    l2_kernels,
    rescale_buffers,
    rescale_kernels,
    zero_weight_target,
)
from mexc.numerics import (
    ADAMW_SITES,
    DENOM_FRAC,
    MOMENT_BITS,
    RATIO_CAP,
    RATIO_FRAC,
    FixedScalar,
)

I8, I32, I64 = "int8", "int32", "int64"
KEY_VIEWS = {"key_m": 4, "key_r": 8, "key_w": 11}  # one-element views of `keys`
STEP_SCALARS = 6  # lr: (lr_t, eps_t, wd_t) as (num, shift) pairs


@dataclass(frozen=True)
class AdamSpec:
    """What a compiled AdamW kernel set is specialized on: the tensor layout, grouping and
    rounding (`layout`, an UpdateSpec whose momentum and decay are unused) and 1 - beta."""

    layout: UpdateSpec
    one_minus_beta1: FixedScalar
    one_minus_beta2: FixedScalar
    l2: FixedScalar = FixedScalar(0, 0)  # Adam's coupled decay (numerics 12b step 1b)


def adamw_buffers(spec: AdamSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every buffer the kernels name, except the views in KEY_VIEWS.
    Inputs w, w_exp, grad, grad_exp, m, m_exp, r, r_exp, lr, keys; outputs w_out, w_exp_out,
    m_out, m_exp_out, r_out, r_exp_out; the rest is scratch."""
    lay = spec.layout
    full, g, one = lay.shape, (lay.groups,), (1,)
    out = {"w": (full, I8), "w_exp": (one, I32), "grad": (full, I32), "grad_exp": (one, I32)}
    out |= {"m": (full, I8), "m_exp": (g, I32), "r": (full, I8), "r_exp": (g, I32)}
    out |= {"lr": ((STEP_SCALARS,), I32), "keys": ((ADAMW_SITES,), I64)}
    out |= {"s_g": (g, I32), "e_g": (g, I32), "t_m": (g, I32), "acc_m": (full, I32)}
    out |= {"s_m": (g, I32), "m_exp_out": (g, I32), "m_out": (full, I8)}
    out |= {"t_v": (g, I32), "acc_v": (full, I32), "rho": (full, I32), "rho_exp": (g, I32)}
    out |= {"s_r": (g, I32), "r_exp_out": (g, I32), "r_out": (full, I8), "q": (full, I32)}
    out |= {"eps_units": (g, I32)}
    out |= {"w_acc": (full, I32), "e_w": (one, I32), "s_w": (one, I32)}
    out |= {"w_exp_out": (one, I32), "w_out": (full, I8)}
    out |= rescale_buffers(lay)
    if spec.l2.num:
        out |= {"t_l2": (g, I32), "acc_l2": (full, I32), "s_l2": (g, I32), "e_l2": (g, I32)}
    return out


def _grad_inputs(lay: UpdateSpec) -> tuple[te.Tensor, te.Tensor, te.Tensor]:
    gshape = (lay.kgroups,)
    return (
        te.placeholder(lay.kshape, I32, name="grad"),
        te.placeholder(gshape, I32, name="s_g"),
        te.placeholder(gshape, I32, name="e_g"),
    )


def m_sum(spec: AdamSpec, name: str, g_site: int) -> tirx.PrimFunc:
    """acc_m = m + c1 (g - m) as three aligned terms (step 2), g = compaction of grad by s_g
    [g_site]. Parameters (grad, s_g, e_g, m, m_exp, keys, t_m, acc_m)."""
    lay = spec.layout
    op, b = _Ops(lay), lay.bits - 1
    c1 = spec.one_minus_beta1
    grad, s_g, e_g = _grad_inputs(lay)
    m = te.placeholder(lay.kshape, I8, name="m")
    m_exp = te.placeholder((lay.kgroups,), I32, name="m_exp")
    keys = te.placeholder((ADAMW_SITES,), I64, name="keys")
    mb, cb = MOMENT_BITS - 1, c1.num.bit_length()
    t = te.compute(
        (lay.kgroups,),
        lambda g: aligned_target(
            [(m_exp[g], mb), (m_exp[g] - c1.shift, mb + cb), (e_g[g] - c1.shift, b + cb)]
        ),
        name="t",
    )

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        g, flat = op.gi(idx), op.flat(idx)
        gm = op.compacted(grad[idx], s_g[g], keys[g_site], flat)
        mv = m[idx].astype(I64)
        m_term = op.term(mv, t[g] - m_exp[g], keys[1], flat)
        mc_term = op.term(-mv * c1.num, t[g] - (m_exp[g] - c1.shift), keys[2], flat)
        g_term = op.term(gm * c1.num, t[g] - (e_g[g] - c1.shift), keys[3], flat)
        return (m_term + mc_term + g_term).astype(I32)

    acc = te.compute(lay.kshape, body, name="acc")
    return prim_func([grad, s_g, e_g, m, m_exp, keys, t, acc], name)


def v_sum(spec: AdamSpec, name: str, g_site: int) -> tirx.PrimFunc:
    """acc_v = r^2 + c2 (g^2 - r^2) as three aligned terms (step 3), g = compaction of grad by
    s_g [g_site]. Parameters (grad, s_g, e_g, r, r_exp, keys, t_v, acc_v)."""
    lay = spec.layout
    op, b = _Ops(lay), lay.bits - 1
    c2 = spec.one_minus_beta2
    grad, s_g, e_g = _grad_inputs(lay)
    r = te.placeholder(lay.kshape, I8, name="r")
    r_exp = te.placeholder((lay.kgroups,), I32, name="r_exp")
    keys = te.placeholder((ADAMW_SITES,), I64, name="keys")
    rb, cb = 2 * (MOMENT_BITS - 1), c2.num.bit_length()
    t = te.compute(
        (lay.kgroups,),
        lambda g: aligned_target(
            [
                (2 * r_exp[g], rb),
                (2 * r_exp[g] - c2.shift, rb + cb),
                (2 * e_g[g] - c2.shift, 2 * b + cb),
            ]
        ),
        name="t",
    )

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        g, flat = op.gi(idx), op.flat(idx)
        gm = op.compacted(grad[idx], s_g[g], keys[g_site], flat)
        rv = r[idx].astype(I64)
        r2 = rv * rv
        r_term = op.term(r2, t[g] - 2 * r_exp[g], keys[5], flat)
        rc_term = op.term(-r2 * c2.num, t[g] - (2 * r_exp[g] - c2.shift), keys[6], flat)
        g_term = op.term(gm * gm * c2.num, t[g] - (2 * e_g[g] - c2.shift), keys[7], flat)
        return (r_term + rc_term + g_term).astype(I32)

    acc = te.compute(lay.kshape, body, name="acc")
    return prim_func([grad, s_g, e_g, r, r_exp, keys, t, acc], name)


def _root_shift(e_v: tirx.PrimExpr) -> tirx.PrimExpr:
    """numerics.root_exponent_shift: 30 or 31, so that e_v - k is even."""
    return 30 + tirx.floormod(e_v - 30, 2)


def root(spec: AdamSpec, name: str) -> tirx.PrimFunc:
    """rho = isqrt(max(acc_v, 0) << k) and rho_exp = (e_v - k) / 2 per group (step 4).
    Parameters (acc_v, t_v, rho, rho_exp)."""
    lay = spec.layout
    op = _Ops(lay)
    acc = te.placeholder(lay.kshape, I32, name="acc_v")
    e_v = te.placeholder((lay.kgroups,), I32, name="t_v")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        k = _root_shift(e_v[op.gi(idx)]).astype(I64)
        return isqrt(tirx.max(acc[idx].astype(I64), tirx.const(0, I64)) << k).astype(I32)

    rho = te.compute(lay.kshape, body, name="rho")
    rho_exp = te.compute(
        (lay.kgroups,), lambda g: tirx.floordiv(e_v[g] - _root_shift(e_v[g]), 2), name="rho_exp"
    )
    return prim_func([acc, e_v, rho, rho_exp], name)


def _ratio_exp(m_exp: te.Tensor, r_exp: te.Tensor, g: tirx.PrimExpr) -> tirx.PrimExpr:
    """e_q = e_m - e_r - RATIO_FRAC of one group."""
    return m_exp[g] - r_exp[g] - RATIO_FRAC


def ratio(spec: AdamSpec, name: str, native_division: bool) -> tirx.PrimFunc:
    """q = clamp(idiv_round(m << 15, (r << 8) + E), +-RATIO_CAP) (step 5; numerics.adam_ratio),
    E = eps_t in units of 2^(e_r - 8) per group. Parameters (m_out, m_exp_out, r_out,
    r_exp_out, lr, eps_units, q); lr[2], lr[3] = eps_t; eps_units: E per group (scratch)."""
    lay = spec.layout
    op = _Ops(lay)
    m = te.placeholder(lay.kshape, I8, name="m_out")
    m_exp = te.placeholder((lay.kgroups,), I32, name="m_exp_out")
    r = te.placeholder(lay.kshape, I8, name="r_out")
    r_exp = te.placeholder((lay.kgroups,), I32, name="r_exp_out")
    lr = te.placeholder((STEP_SCALARS,), I32, name="lr")
    zero = tirx.const(0, I64)

    def eps_units(g: tirx.PrimExpr) -> tirx.PrimExpr:
        s = (lr[3] + r_exp[g] - DENOM_FRAC).astype(I64)
        num = lr[2].astype(I64)
        right = shift_signed(num, tirx.max(s, zero), zero, zero, False)
        return tirx.if_then_else(s >= 0, right, shift_left_saturating(num, -s)).astype(I32)

    e = te.compute((lay.kgroups,), eps_units, name="eps_units")
    cap = tirx.const(RATIO_CAP, I64)

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        mv = m[idx].astype(I64)
        d = (r[idx].astype(I64) << DENOM_FRAC) + e[op.gi(idx)].astype(I64)
        # a product, not a shift: a left shift of a negative value is undefined in C++
        q = idiv_round(mv * (1 << (DENOM_FRAC + RATIO_FRAC)), tirx.max(d, 1), native_division)
        signed_cap = tirx.if_then_else(mv < 0, -cap, cap)
        out = tirx.if_then_else(d == 0, signed_cap, tirx.max(tirx.min(q, cap), -cap))
        return tirx.if_then_else(mv == 0, zero, out).astype(I32)

    q = te.compute(lay.kshape, body, name="q")
    return prim_func([m, m_exp, r, r_exp, lr, e, q], name)


def _step_inputs(lay: UpdateSpec) -> tuple[te.Tensor, ...]:
    """The placeholders w_target and w_step share: w, w_exp, q, m_exp_out, r_exp_out, lr."""
    gshape = (lay.kgroups,)
    return (
        te.placeholder(lay.kshape, I8, name="w"),
        te.placeholder((1,), I32, name="w_exp"),
        te.placeholder(lay.kshape, I32, name="q"),
        te.placeholder(gshape, I32, name="m_exp_out"),
        te.placeholder(gshape, I32, name="r_exp_out"),
        te.placeholder((STEP_SCALARS,), I32, name="lr"),
    )


def w_target(spec: AdamSpec, name: str) -> tirx.PrimFunc:
    """e_w of step 6 (te_update.zero_weight_target), the update being q * lr.num at
    e_q = m_exp_out - r_exp_out - RATIO_FRAC. Parameters (w, w_exp, q, m_exp_out, r_exp_out,
    lr, e_w)."""
    lay = spec.layout
    op = _Ops(lay)
    w, w_exp, q, m_exp, r_exp, lr = _step_inputs(lay)

    def e_q(idx: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        return _ratio_exp(m_exp, r_exp, op.gi(idx))

    e_w = zero_weight_target(lay.kshape, w, w_exp, q, e_q, lr, lay.rows_first)
    return prim_func([w, w_exp, q, m_exp, r_exp, lr, e_w], name)


def w_step(spec: AdamSpec, name: str) -> tirx.PrimFunc:
    """w_acc = w - align(q * lr_t.num) [9] - shift_right(w * wd_t.num, wd_t.shift) [10]
    (steps 6 and 7). Parameters (w, e_w, q, m_exp_out, r_exp_out, lr, keys, w_acc)."""
    lay = spec.layout
    op = _Ops(lay)
    w, w_exp, q, m_exp, r_exp, lr = _step_inputs(lay)
    keys = te.placeholder((ADAMW_SITES,), I64, name="keys")

    def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = op.flat(idx)
        u = q[idx].astype(I64) * lr[0].astype(I64)  # |u| < 2^26
        d = (w_exp[0] - (_ratio_exp(m_exp, r_exp, op.gi(idx)) - lr[1])).astype(I64)
        right = shift_signed(u, tirx.max(d, 0), keys[9], flat, lay.stochastic)
        step = tirx.if_then_else(d >= 0, right, shift_left_saturating(u, -d))
        wv = w[idx].astype(I64)
        wd = wv * lr[4].astype(I64)
        decay = shift_signed(wd, lr[5].astype(I64), keys[10], flat, lay.stochastic)
        return (wv - step - decay).astype(I32)

    w_acc = te.compute(lay.kshape, body, name="w_acc")
    return prim_func([w, w_exp, q, m_exp, r_exp, lr, keys, w_acc], name)


@trial_cached(lambda spec, name, native_division: (spec, name, native_division))
def adamw_kernels(spec: AdamSpec, name: str, native_division: bool) -> list[Kernel]:
    """The kernels of one parameter's AdamW update in launch order (module docstring);
    `native_division`: the target divides natively (te_divide.idiv_round)."""
    lay = spec.layout
    shape, bits, grouped, st = lay.kshape, lay.bits, lay.grouped, lay.stochastic
    out = [
        Kernel(
            compaction_shift(shape, bits, grouped, f"{name}_grad", shared_exp=True),
            ("grad", "grad_exp", "s_g", "e_g"),
            reduce=True,
        )
    ]
    grad, g_site = ("grad", "s_g", "e_g"), 0
    if spec.l2.num:  # Adam's L2 term (step 1b), sites 12, 13 and 14
        l2 = replace(lay, weight_decay=spec.l2)
        decay, grad = l2_kernels(l2, grad, name, "l2", (0, 12, 13), ADAMW_SITES)
        out += decay
        g_site = 14
    m_args = (*grad, "m", "m_exp", "keys", "t_m", "acc_m")
    v_args = (*grad, "r", "r_exp", "keys", "t_v", "acc_v")
    m_buffers = ("acc_m", "t_m", "s_m", "m_exp_out", "key_m", "m_out")
    r_buffers = ("rho", "rho_exp", "s_r", "r_exp_out", "key_r", "r_out")
    return [
        *out,
        Kernel(m_sum(spec, f"{name}_m_sum", g_site), m_args, False),
        *compaction_kernels(shape, MOMENT_BITS, grouped, st, f"{name}_m", m_buffers),
        Kernel(v_sum(spec, f"{name}_v_sum", g_site), v_args, False),
        Kernel(root(spec, f"{name}_root"), ("acc_v", "t_v", "rho", "rho_exp"), reduce=False),
        *compaction_kernels(shape, MOMENT_BITS, grouped, st, f"{name}_r", r_buffers),
        Kernel(
            ratio(spec, f"{name}_ratio", native_division),
            ("m_out", "m_exp_out", "r_out", "r_exp_out", "lr", "eps_units", "q"),
            reduce=False,
        ),
        Kernel(
            w_target(spec, f"{name}_w_target"),
            ("w", "w_exp", "q", "m_exp_out", "r_exp_out", "lr", "e_w"),
            reduce=False,
        ),
        Kernel(
            w_step(spec, f"{name}_w_step"),
            ("w", "e_w", "q", "m_exp_out", "r_exp_out", "lr", "keys", "w_acc"),
            reduce=False,
        ),
        *rescale_kernels(lay, f"{name}_w", "key_w"),
    ]
