"""Attention ops: softmax over the last axis and batched matmul, and their gradients."""

from __future__ import annotations

from typing import Any

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.ops.common import Grads, elementwise_types, pointwise_vjp, static_int, tid
from mexc.ops.dense import CAP
from mexc.ops.registry import OpDef, Pattern, define
from mexc.types import mx


def _matmul_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    a, b = n.inputs
    node = w.emit(Op.MATMUL_GRAD, [dy, a, b], (mx(*w.type(a).shape), mx(*w.type(b).shape)), n.loc)
    return [node.result(0) if w.needs[a] else None, node.result(1) if w.needs[b] else None]


def _matmul_k(n: Node, t: Any) -> int:
    return int(t(0).shape[-1])  # a[..., M, K] @ b[..., K, N]


def _matmul_grad_k(n: Node, t: Any) -> int:
    dy = t(0).shape  # da = dy @ b^T reduces over N; db = a^T @ dy over M
    return int(max(dy[-1], dy[-2]))


def _softmax(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.softmax_forward(a[0], env.ctx, tid(n)),)


def _softmax_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.softmax_backward(a[0], a[1], env.ctx, tid(n)),)


def _matmul(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.matmul_forward(a[0], a[1], env.ctx, tid(n)),)


def _matmul_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return tuple(K.matmul_backward(a[0], a[1], a[2], env.ctx, tid(n)))


def _softmax_convert(c: Any, n: Any) -> Value:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    rank = len(c.shape(n.args[0]))
    if dim is None or static_int(dim) % rank != rank - 1:
        raise UnsupportedOpError(c.describe(n, "softmax is supported over the last axis only"))
    return c.emit(Op.SOFTMAX, [c.arg(n.args[0])], n)


def _matmul_convert(c: Any, n: Any) -> Value:
    a, b = n.args[0], n.args[1]
    sa, sb = c.shape(a), c.shape(b)
    if len(sa) < 3 or sa[:-2] != sb[:-2] or sa[-1] != sb[-2]:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"multiplies {list(sa)} by {list(sb)}; mexc "
                "supports batched [..., M, K] @ [..., K, N] with "
                "equal batch dims (use nn.Linear for weights)",
            )
        )
    return c.emit(Op.MATMUL, [c.arg(a), c.arg(b)], n)


define(
    OpDef(
        Op.SOFTMAX,
        {"rid": -1},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.SOFTMAX_GRAD, lambda n: n.out),
        reference=_softmax,
        frontend=(
            Pattern("function", ("torch.softmax", "torch.nn.functional.softmax"), _softmax_convert),
            Pattern("method", ("softmax",), _softmax_convert),
        ),
        lower={"tir": "step_plan:PlanRules.softmax", "c": "emit:_softmax"},
        doc="softmax over the last axis through the integer exp table",
    ),
    OpDef(
        Op.SOFTMAX_GRAD,
        {"rid": -1},
        reference=_softmax_grad,
        lower={"tir": "step_plan:PlanRules.softmax_grad", "c": "emit:_softmax_grad"},
        doc="dx = p * (dy - sum(p * dy))",
    ),
    OpDef(
        Op.MATMUL,
        {"rid": -1, **CAP},
        types=elementwise_types,  # product and compaction in one kernel
        vjp=_matmul_vjp,
        reference=_matmul,
        frontend=(
            Pattern("function", ("operator.matmul", "torch.matmul", "torch.bmm"), _matmul_convert),
        ),
        lower={
            "tir": "step_plan:PlanRules.matmul",
            "c": "emit:_matmul",
            "gemm": "products_build:matmul_forms",
        },
        product=True,
        reduction=_matmul_k,
        doc="batched [..., M, K] @ [..., K, N] of two activations, compacted",
    ),
    OpDef(
        Op.MATMUL_GRAD,
        {"rid": -1, **CAP},
        reference=_matmul_grad,
        lower={
            "tir": "step_plan:PlanRules.matmul_grad",
            "c": "emit:_matmul_grad",
            "gemm": "products_build:matmul_grad_forms",
        },
        product=True,
        reduction=_matmul_grad_k,
        doc="da = dy @ b^T and db = a^T @ dy, compacted",
    ),
)
