"""The graph boundary: the batch, the labels, parameters and state, and the one quantization."""

from __future__ import annotations

from typing import Any

from mexc import kernels as K
from mexc.ir import Node, Op
from mexc.ops.common import mx_like
from mexc.ops.registry import OpDef, define, op_def
from mexc.types import Exp, mx


def _input_types(r: Any, n: Node) -> None:
    """The float batch is quantized once, by a QUANTIZE node; integer ids (an input with a
    vocabulary) are read as they are, by embedding tables."""
    if int(n.attrs.vocab):
        r.copy(n, n.types)
        return
    raw = r.b.add(Op.INPUT, (), n.types, n.attrs, n.loc)
    q = r.b.add(
        Op.QUANTIZE, [raw.out], mx_like(n.type), op_def(Op.QUANTIZE).make(bits=r.ctx.bits), n.loc
    )
    r.env[n.out] = q.out


def _label_types(r: Any, n: Node) -> None:
    r.copy(n, n.types)


def _param_types(r: Any, n: Node) -> None:
    r.copy(n, (mx_like(n.type),))


def _state_types(r: Any, n: Node) -> None:
    if n.attrs.role in ("running_mean", "running_var"):
        # one exponent per channel: channel variances differ by orders of magnitude
        r.copy(n, (mx(*n.type.shape, exp=Exp.AXIS0),))
    else:
        r.copy(n, (mx_like(n.type),))


def _input(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (env.x,)


def _label(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (env.y,)


def _state(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (env.state[str(n.attrs.name)],)


def _quantize(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    rows = env.ctx.rows
    return (K.quantize(a[0], int(n.attrs.bits), None if rows is None else rows.max_float),)


define(
    OpDef(
        Op.INPUT,
        {"name": "x", "vocab": 0},
        types=_input_types,
        reference=_input,
        lower={"tir": "step_plan:PlanRules.input", "c": "emit:_input"},
        boundary=True,
        float_results=(0,),
        doc="the input batch: floats, or integer ids in [0, vocab) (vocab > 0) that embedding "
        "tables read",
        batch_results=True,
    ),
    OpDef(
        Op.LABEL,
        {"name": "y", "num_classes": 0},
        types=_label_types,
        reference=_label,
        lower={"tir": "step_plan:PlanRules.label", "c": "emit:_label"},
        boundary=True,
        doc="the integer labels of the batch",
        batch_results=True,
    ),
    OpDef(
        Op.PARAM,
        {"name": "", "role": "weight"},
        types=_param_types,
        reference=_state,
        lower={"tir": "step_plan:PlanRules.state", "c": "emit:_state"},
        boundary=True,
        doc="a trained parameter (persistent state)",
    ),
    OpDef(
        Op.STATE,
        {"name": "", "role": "velocity", "owner": ""},
        types=_state_types,
        reference=_state,
        lower={"tir": "step_plan:PlanRules.state", "c": "emit:_state"},
        boundary=True,
        doc="persistent non-trained state: velocities, BN running statistics",
    ),
    OpDef(
        Op.QUANTIZE,
        {"bits": 8},
        reference=_quantize,
        lower={"tir": "step_plan:PlanRules.quantize", "c": "emit:_quantize"},
        reads_float=True,
        no_grad=True,
        doc="the float batch -> MX, at the host boundary",
        data_parallel=True,
    ),
)
