"""Parameters and buffers read through an index map (`gather_param`) and its gradient.

A model that indexes or rearranges a parameter before using it (a relative-position bias table
indexed by a buffer of offsets, `table[idx].view(N, N, -1).permute(2, 0, 1)`; a sliced
positional embedding; an attention-mask buffer broadcast over windows) reads, for every element
of the result, one element of the parameter. The frontend folds that chain of indexing and
rearranging ops into one map of flat indices (`fold`, applied to an `arange` of the parameter's
size on the host, so torch itself computes it) and emits one `gather_param` where an activation
meets it (an add, a product, an attention mask). Integer buffers (the offsets) fold to their
values the same way. The folding runs torch on the host (mexc.frontend_fold); this module
holds what the op needs, and imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.mx import MX, Acc
from mexc.ops.common import Grads, ParamView, elementwise_types, tir_rule
from mexc.ops.registry import OpDef, define
from mexc.types import acc


@dataclass(frozen=True, eq=False)
class Gathered:
    """A module parameter (`source`, a get_attr node) read through indexing and rearranging:
    element i of the value is source.flat[index.flat[i]]. A constant (a buffer, or a tensor the
    forward computes: `source` its node) carries its `value`, the fewest leading rows that
    repeat, which the program holds."""

    source: Any
    index: np.ndarray
    value: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class Const:
    """A tensor the model computes without its input or parameters (an integer buffer of
    relative-position offsets, an attention mask made by x.new_zeros and written into): a
    constant of the graph, folded on the host (mexc.frontend_fold). `value` is a torch
    tensor (for an activation whose shape and dtype a maker reads, x.new_zeros: zeros)."""

    value: Any


@dataclass(frozen=True, eq=False)
class Concatenated:
    """Parameters and constants concatenated (BEiT's and EVA's q/k/v bias, torch.cat((q_bias,
    k_bias, v_bias)) with k_bias a zero buffer): the parts along axis `dim` (counted from the
    end, so that it holds where the value broadcasts over an activation). Where it meets an
    activation, each part is a gather_param of its slice of the activation's shape and the
    parts a concatenation (mexc.ops.tensor.folded_value)."""

    parts: tuple[Gathered, ...]
    dim: int  # negative


def is_gathered(c: Any, a: Any) -> bool:
    """`a` is a parameter read through indexing, a constant, or parameters concatenated (an
    add or product with it goes through gathered_value)."""
    return c.is_node(a) and isinstance(c.env.get(a), (Gathered, Const, Concatenated))


def as_gathered(c: Any, a: Any) -> Gathered | None:
    """`a` (a Gathered node, a ParamView, or a get_attr of a parameter or float buffer) as a
    Gathered, else None."""
    if not c.is_node(a):
        return None
    held = c.env.get(a)
    if isinstance(held, Gathered):
        return held
    if isinstance(held, Const) and held.value.is_floating_point():
        return const_gathered(a, held.value.detach().cpu().numpy())
    if isinstance(held, ParamView):
        numel = int(np.prod(c.shape(held.source)))
        return Gathered(held.source, np.arange(numel).reshape(held.shape))
    if a.op == "get_attr":
        t = c.fetch(a)
        if not (hasattr(t, "is_floating_point") and t.is_floating_point()):
            return None
        if c.is_parameter(a):
            return Gathered(a, np.arange(t.numel()).reshape(tuple(t.shape)))
        return const_gathered(a, t.detach().cpu().numpy())  # a buffer: a constant
    return None


def held_values(g: Any) -> np.ndarray | None:
    """A constant Gathered's whole value (its held rows read through its index), else None
    (a parameter's)."""
    if not isinstance(g, Gathered) or g.value is None:
        return None
    return np.ascontiguousarray(g.value.reshape(-1)[g.index])


def static_tensor(c: Any, a: Any) -> np.ndarray | None:
    """The values of `a` where the program would hold them fixed (a buffer, a constant the
    forward computes, either read through indexing), else None (a parameter, an activation)."""
    if not c.is_node(a):
        return None
    held = c.env.get(a)
    if isinstance(held, Const):
        return np.asarray(held.value.detach().cpu().numpy())
    if isinstance(held, Gathered):
        return held_values(held)
    if a.op == "get_attr" and not c.is_parameter(a):
        t = c.fetch(a)
        return np.asarray(t.detach().cpu().numpy()) if hasattr(t, "detach") else None
    return None


def const_gathered(a: Any, values: np.ndarray) -> Gathered:
    """A constant as a Gathered of its fewest leading rows that repeat (a mask expanded over the
    batch is held once, and its index repeats with that period)."""
    if values.ndim == 0:
        return Gathered(a, np.zeros((), np.int64), values.reshape(1))
    rows = values.shape[0]
    p = _period(values.reshape(rows, -1))
    held = values[:p]
    index = np.arange(held.size).reshape(held.shape)
    return Gathered(a, np.tile(index, (rows // p,) + (1,) * (values.ndim - 1)), held)


def _period(index: np.ndarray) -> int:
    """The fewest leading rows whose repetition gives `index` (rows = batch entries), compared
    in place (no tiled copy)."""
    rows = index.shape[0]
    for p in range(1, rows + 1):
        if rows % p == 0 and (index.reshape(rows // p, p, -1) == index[:p].reshape(p, -1)).all():
            return p
    return rows


def gathered_value(c: Any, n: Any, g: Gathered, out: tuple[int, ...]) -> Value:
    """g broadcast to `out` (an activation's shape, batch first) as a gather_param of its
    source: a trained parameter, or a float buffer held as a constant."""
    index = g.index
    padded = index.reshape((1,) * (len(out) - index.ndim) + index.shape)
    try:
        full = np.broadcast_to(padded, out) if index.ndim <= len(out) else None
    except ValueError:
        full = None
    if full is None:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"combines an activation of shape {list(out)} with a parameter or buffer "
                f"indexed to shape {list(index.shape)}, which does not broadcast to it",
            )
        )
    if padded.shape[0] == 1:  # the same for every batch entry: one row, never copied wider
        period, rows = 1, np.broadcast_to(padded[0], out[1:]).reshape(1, -1)
    else:
        rows = full.reshape(out[0], -1)
        period = _period(rows)
    source = g.source
    if g.value is not None:  # made in forward (an attention mask): a constant, never trained
        p = c.constant(source.name, g.value, "embedding")
    else:  # a parameter; a buffer is a constant of the program, never trained
        p = c.get_param(source, "embedding")
    flat = tuple(int(i) for i in rows[:period].reshape(-1))
    return c.emit_as(Op.GATHER_PARAM, [p], out, index=flat, period=period)


# ----------------------------------------------------------------------------- rules


def _gather_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """The source's gradient: dy summed, per source element, over the batch and the elements
    that read it (int32, at dy's exponent)."""
    dy = dys[0]
    assert dy is not None
    p = n.inputs[0]
    dp = w.emit(
        Op.GATHER_PARAM_GRAD,
        [dy],
        acc(*w.type(p).shape),
        n.loc,
        index=n.attrs.index,
        period=n.attrs.period,
    )
    w.set_param_grad(p, dp.out, n)
    return [None]


def index_rows(n: Node, batch: int) -> np.ndarray:
    """The index map as (period, per-sample) rows; an error where the batch (a data-parallel
    worker's share) is not whole periods, whose rows would start mid-period."""
    period = int(n.attrs.period)
    if batch % period:
        raise UnsupportedOpError(
            f"node %{n.id} (gather_param{', ' + n.loc if n.loc else ''}) repeats its index every "
            f"{period} rows of the batch, which {batch} rows do not hold whole; choose a batch "
            "(per data-parallel worker) that is a multiple of it"
        )
    return np.asarray(n.attrs.index, np.int64).reshape(period, -1)


def _rows(n: Node, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """(the index map as (period, per-sample) rows, the batch)."""
    return index_rows(n, shape[0]), shape[0]


def _gather_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    rows, batch = _rows(n, tuple(n.type.shape))
    per = [K.gather_param_forward(a[0], r, batch // rows.shape[0]) for r in rows]
    m = np.stack([v.m for v in per], axis=1).reshape(n.type.shape)
    return (MX(np.ascontiguousarray(m), per[0].e),)


def _gather_grad_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    dy: MX = a[0]
    rows, batch = _rows(n, tuple(dy.shape))
    period = rows.shape[0]
    # batch entry b reads row b % period: dy seen as (batch / period, period * per-sample)
    seen = MX(np.asarray(dy.m).reshape(batch // period, -1), dy.e)
    dp = K.gather_param_grad(seen, rows.reshape(-1), int(np.prod(n.type.shape)))
    return (Acc(dp.a.reshape(n.type.shape), dp.e),)


define(
    OpDef(
        Op.GATHER_PARAM,
        {"index": (), "period": 1},
        types=elementwise_types,
        vjp=_gather_vjp,
        reference=_gather_ref,
        lower={"tir": tir_rule("gather_param"), "c": "emit:_gather_param"},
        doc="a parameter read through an index map, over the batch: y[b, j] = p.flat[index[(b "
        "% period) * S + j]] (S per-sample elements); mantissas copied, exponent kept",
        batch_results=True,
    ),
    OpDef(
        Op.GATHER_PARAM_GRAD,
        {"index": (), "period": 1},
        reference=_gather_grad_ref,
        lower={"tir": tir_rule("gather_param_grad"), "c": "emit:_gather_param_grad"},
        doc="the gathered parameter's gradient: dy summed per source element over the batch "
        "and the elements that read it, int32",
        data_parallel=True,
        batch_partial=(0,),
    ),
)
