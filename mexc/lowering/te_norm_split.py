"""Batch-norm kernels of a data-parallel worker's step (docs/distributed.md): te_norm's fused
kernels cut where kernels.norm agrees a value with the other workers (docs/numerics.md §16).
Each cut leaves a per-channel buffer of this worker's partial sums or maxima; the plan adds
them over the workers with a host collective (plan_core.HostLaunch) before the next kernel
reads them. Counts (M) are the whole batch's, given by the caller; the element indices of the
rounding keys are local, the worker's first global element coming in the key's high half
(te_compaction.random_word).

Forward (sites of kernels.batchnorm_forward_train): bn_sum -> [sum] -> bn_center_max ->
[max] -> bn_var_sum (site 0) -> [sum] -> bn_var_finish; the xhat compaction's maxima by
bn_xhat_max -> [max] -> bn_xhat_shift_of. The backward's sums and maxima use
common_shift_of_max and te_compaction.abs_max_kernel."""

from __future__ import annotations

from tvm import te, tirx

from mexc.lowering.te_compaction import _flat_index, shift_right32
from mexc.lowering.te_compaction import _i64 as _c
from mexc.lowering.te_norm import (
    NCS,
    _div_const,
    _func,
    _ncs_sum,
    _per_channel,
    _to_i32,
    _xhat_inputs,
    channel_abs_max,
    common_shift_of,
    common_tops,
    shift_of_tops,
    var_statistics,
)
from mexc.numerics import FixedScalar

I8, I32, I64 = "int8", "int32", "int64"


def bn_sum(shape: NCS, name: str) -> tirx.PrimFunc:
    """This worker's sum of x per channel (int32: |x| <= 127 over fewer than 2^24 values).
    Parameters (x, ssum)."""
    x = te.placeholder(shape, I8, name="x")
    ssum = _ncs_sum(shape, lambda n, c, s: x[n, c, s].astype(I64), "ssum")
    return _func([x, _to_i32(ssum)], name)


def bn_center_max(shape: NCS, f: int, m: int, name: str) -> tirx.PrimFunc:
    """mu = idiv_round(ssum << f, M) from the whole batch's sum, and this worker's max
    |(x << f) - mu| per channel (< 2^16). Parameters (x, ssum, mu, amax)."""
    x = te.placeholder(shape, I8, name="x")
    ssum = te.placeholder((shape[1],), I32, name="ssum")
    mu = _per_channel(shape, lambda c: _div_const(ssum[c].astype(I64) << _c(f), m), "mu64")
    amax = channel_abs_max(shape, lambda n, c, s: (x[n, c, s].astype(I64) << _c(f)) - mu[c])
    return _func([x, ssum, _to_i32(mu), _to_i32(amax)], name)


def bn_var_sum(shape: NCS, f: int, m: int, stochastic: bool, name: str) -> tirx.PrimFunc:
    """The variance pre-shift r per channel (the smallest with M * ceil(amax / 2^r)^2 <=
    2^31 - 1, amax the whole batch's) and this worker's sum of tq^2, tq = round(xc / 2^r) (the
    key's site). Parameters (x, mu, amax, key, r, vsum)."""
    x = te.placeholder(shape, I8, name="x")
    mu = te.placeholder((shape[1],), I32, name="mu")
    amax = te.placeholder((shape[1],), I32, name="amax")
    key = te.placeholder((1,), I64, name="key")
    t = te.reduce_axis((0, 32), "t")

    def over(c: tirx.PrimExpr) -> tirx.PrimExpr:
        tt = t.var.astype(I64)
        top = (amax[c].astype(I64) + (_c(1) << tt) - 1) >> tt
        return te.sum(tirx.if_then_else(_c(m) * top * top > _c(2**31 - 1), 1, 0), axis=t)

    r = _per_channel(shape, over, "r")

    def tq(n: tirx.PrimExpr, c: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        xc = (x[n, c, s].astype(I32) << f) - mu[c]
        v = shift_right32(xc, r[c], key[0], _flat_index(shape, (n, c, s)), stochastic)
        return v * v

    vsum = _ncs_sum(shape, tq, "vsum", I32, lanes=True)
    return _func([x, mu, amax, key, r, _to_i32(vsum)], name)


def bn_var_finish(
    channels: int, f: int, m: int, eps: FixedScalar, name: str, native_division: bool = False
) -> tirx.PrimFunc:
    """te_norm.bn_var's statistics from the whole batch's vsum: var, var_u, ev, rstd, rstd_e
    and e_c = ex - f. Parameters (vsum, r, ex, var, var_u, ev, rstd, rstd_e, e_c)."""
    shape = (1, channels, 1)
    vsum = te.placeholder((channels,), I32, name="vsum")
    r = te.placeholder((channels,), I32, name="r")
    ex = te.placeholder((1,), I32, name="ex")
    v64 = te.compute((channels,), lambda c: vsum[c].astype(I64), name="vsum64")
    outs = var_statistics(shape, v64, r, ex, f, m, eps, native_division)
    return _func([vsum, r, ex, *outs], name)


def bn_xhat_max(shape: NCS, f: int, name: str) -> tirx.PrimFunc:
    """This worker's max |xhat accumulator| per channel (te_norm._xhat_inputs).
    Parameters (x, mu, rstd, amax)."""
    inputs, acc = _xhat_inputs(shape, f)
    return _func([*inputs, channel_abs_max(shape, acc)], name)


def bn_xhat_shift_of(channels: int, bits: int, name: str) -> tirx.PrimFunc:
    """te_norm.bn_xhat_shift from the whole batch's per-channel maxima.
    Parameters (amax, rstd_e, e_c, e_grp, sh, e_out)."""
    amax = te.placeholder((channels,), I32, name="amax")
    rstd_e = te.placeholder((channels,), I32, name="re")
    e_c = te.placeholder((1,), I32, name="e_c")
    e_grp = te.compute((channels,), lambda c: e_c[0] + rstd_e[c], name="e_grp")
    sh, e_out = common_shift_of(amax, e_grp, bits)
    return _func([amax, rstd_e, e_c, e_grp, sh, e_out], name)


def channel_max(shape: NCS, name: str) -> tirx.PrimFunc:
    """This worker's max |acc| per channel of an (N, C, S) int32 accumulator.
    Parameters (acc, amax)."""
    acc = te.placeholder(shape, I32, name="acc")
    amax = channel_abs_max(shape, lambda n, c, s: acc[n, c, s])
    return _func([acc, amax], name)


def common_shift_of_max(channels: int, bits: int, name: str) -> tirx.PrimFunc:
    """te_norm.common_shift from the whole batch's per-channel maxima.
    Parameters (amax, e_grp, sh, e_out)."""
    amax = te.placeholder((channels,), I32, name="amax")
    e_grp = te.placeholder((channels,), I32, name="e_grp")
    sh, e_out = common_shift_of(amax, e_grp, bits)
    return _func([amax, e_grp, sh, e_out], name)


# compact_common over groups that are this worker's rows (LayerNorm's rows: kernels._common's
# `axis == 0` case): each worker's best exponent and whether it has a non-zero group are agreed,
# not the groups' maxima


def group_tops(groups: int, bits: int, name: str) -> tirx.PrimFunc:
    """This worker's (top, emax) of compact_common from its groups' maxima.
    Parameters (amax, e_grp, tops)."""
    amax = te.placeholder((groups,), I32, name="amax")
    e_grp = te.placeholder((groups,), I32, name="e_grp")
    return _func([amax, e_grp, common_tops(amax, e_grp, bits)], name)


def xhat_group_tops(groups: int, bits: int, name: str) -> tirx.PrimFunc:
    """group_tops of LayerNorm's xhat, e_grp = e_c + rstd_e computed here.
    Parameters (amax, rstd_e, e_c, e_grp, tops)."""
    amax = te.placeholder((groups,), I32, name="amax")
    rstd_e = te.placeholder((groups,), I32, name="re")
    e_c = te.placeholder((1,), I32, name="e_c")
    e_grp = te.compute((groups,), lambda c: e_c[0] + rstd_e[c], name="e_grp")
    return _func([amax, rstd_e, e_c, e_grp, common_tops(amax, e_grp, bits)], name)


def group_shift_of_tops(groups: int, name: str) -> tirx.PrimFunc:
    """compact_common's (sh, e_out) from the whole batch's (top, emax) (the largest over the
    workers). Parameters (tops, e_grp, sh, e_out)."""
    tops = te.placeholder((2,), I32, name="tops")
    e_grp = te.placeholder((groups,), I32, name="e_grp")
    sh, e_out = shift_of_tops(tops, e_grp)
    return _func([tops, e_grp, sh, e_out], name)
