"""The loss head: softmax cross-entropy against integer labels, and its gradient."""

from __future__ import annotations

from typing import Any

from mexc import kernels as K
from mexc.ir import Node, Op
from mexc.ops.common import Grads, tid
from mexc.ops.registry import OpDef, define
from mexc.types import Kind, TensorType, mx


def _types(r: Any, n: Node) -> None:
    probs = TensorType(Kind.I16, n.types[0].shape)
    r.copy(n, (probs, n.types[1]))


def _vjp(w: Any, n: Node, dys: Grads) -> Grads:
    logits = n.inputs[0]
    grad = w.emit(Op.SOFTMAX_CE_GRAD, [n.result(0), n.inputs[1]], mx(*w.type(logits).shape), n.loc)
    return [grad.out, None]


def _softmax_ce(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return tuple(K.softmax_ce_forward(a[0], a[1], env.valid, env.ctx, tid(n)))


def _softmax_ce_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.softmax_ce_backward(a[0], a[1], env.valid, env.ctx, tid(n)),)


define(
    OpDef(
        Op.SOFTMAX_CE,
        {"num_classes": 0, "rid": -1},
        types=_types,
        vjp=_vjp,
        reference=_softmax_ce,
        lower={"tir": "step_plan:PlanRules.softmax_ce", "c": "emit:_softmax_ce"},
        loss_head=True,  # its scalar result, the logging-only loss, may be f32
        doc="the loss head: int16 probabilities (p / 2^15) and the (logging-only, float) mean loss",
        data_parallel=True,
        batch_whole=(1,),
    ),
    OpDef(
        Op.SOFTMAX_CE_GRAD,
        {"rid": -1},
        reference=_softmax_ce_grad,
        lower={"tir": "step_plan:PlanRules.softmax_ce_grad", "c": "emit:_softmax_ce_grad"},
        doc="d loss / d logits = (p - onehot(y)) / valid rows",
        data_parallel=True,
    ),
)
