"""Pooling: max, average and global average pooling, and their gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.ops.common import (
    Grads,
    elementwise_types,
    no_saved,
    pair,
    pointwise_vjp,
    shape,
    tid,
    with_index_types,
)
from mexc.ops.registry import OpDef, Pattern, define
from mexc.types import mx

_POOL: dict[str, Any] = {"kernel": (2, 2), "stride": (2, 2), "padding": (0, 0)}


def _relu_before_pool(w: Any, pool: Node) -> Node | None:
    """The ReLU feeding a non-overlapping, unpadded max pool as its only consumer, if any."""
    a = pool.attrs
    src = w.g.node(pool.inputs[0].node)
    overlapping = a.stride[0] < a.kernel[0] or a.stride[1] < a.kernel[1]
    if src.op is not Op.RELU or overlapping or tuple(a.padding) != (0, 0):
        return None
    return src if len(w.users.get(src.out, [])) == 1 else None


def _maxpool_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """Max-pool gradient. After a ReLU the mask is applied at the pooled positions: the pooled
    value is the ReLU output at the argmax, so the result is identical, and the full-size ReLU
    output need not be kept for the backward pass (paper-style memory saving)."""
    dy = dys[0]
    assert dy is not None
    x = n.inputs[0]
    if not w.needs[x]:
        return [None]
    relu = _relu_before_pool(w, n)
    if relu is not None:
        dy = w.emit(Op.RELU_GRAD, [dy, n.out], mx(*w.type(n.out).shape), relu.loc).out
        w.masked_relus.add(relu.id)
    a = n.attrs
    grad = w.emit(
        Op.MAXPOOL2D_GRAD,
        [dy, n.result(1)],
        mx(*w.type(x).shape),
        n.loc,
        kernel=a.kernel,
        stride=a.stride,
        padding=a.padding,
    )
    return [grad.out]


def _maxpool(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return tuple(K.maxpool2d_forward(a[0], at.kernel, at.stride, at.padding))


def _avgpool(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (K.avgpool2d_forward(a[0], at.kernel, at.stride, at.padding, env.ctx, tid(n)),)


def _gap(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.global_avgpool_forward(a[0], env.ctx, tid(n)),)


def _maxpool_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.maxpool2d_backward(
            a[0], a[1], shape(n), at.kernel, at.stride, at.padding, env.ctx, tid(n)
        ),
    )


def _avgpool_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.avgpool2d_backward(a[0], shape(n), at.kernel, at.stride, at.padding, env.ctx, tid(n)),
    )


def _gap_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.global_avgpool_backward(a[0], shape(n), env.ctx, tid(n)),)


def _pool_module(op: Op) -> Callable[..., Value]:
    def convert(c: Any, n: Any, m: Any) -> Value:
        if getattr(m, "ceil_mode", False) or getattr(m, "dilation", 1) not in (1, (1, 1)):
            raise UnsupportedOpError(c.describe(n, "uses ceil_mode or dilation"))
        stride = m.stride if m.stride is not None else m.kernel_size
        return c.emit(
            op,
            [c.arg(n.args[0])],
            n,
            kernel=pair(m.kernel_size),
            stride=pair(stride),
            padding=pair(m.padding),
        )

    return convert


def _pool_function(op: Op) -> Callable[..., Value]:
    def convert(c: Any, n: Any) -> Value:
        kernel = n.args[1] if len(n.args) > 1 else n.kwargs["kernel_size"]
        stride = n.args[2] if len(n.args) > 2 else n.kwargs.get("stride")
        padding = n.args[3] if len(n.args) > 3 else n.kwargs.get("padding", 0)
        stride = kernel if stride in (None, []) else stride
        return c.emit(
            op,
            [c.arg(n.args[0])],
            n,
            kernel=pair(kernel),
            stride=pair(stride),
            padding=pair(padding),
        )

    return convert


def _adaptive_module(c: Any, n: Any, m: Any) -> Value:
    if pair(m.output_size) != (1, 1):
        raise UnsupportedOpError(c.describe(n, "AdaptiveAvgPool2d supports output size 1 only"))
    return c.emit(Op.GLOBAL_AVGPOOL, [c.arg(n.args[0])], n)


def _adaptive_function(c: Any, n: Any) -> Value:
    size = n.args[1] if len(n.args) > 1 else n.kwargs["output_size"]
    if pair(size) != (1, 1):
        raise UnsupportedOpError(c.describe(n, "adaptive_avg_pool2d supports output size 1 only"))
    return c.emit(Op.GLOBAL_AVGPOOL, [c.arg(n.args[0])], n)


def _tir(name: str) -> str:
    return f"step_plan:PlanRules.{name}"


define(
    OpDef(
        Op.MAXPOOL2D,
        dict(_POOL),
        types=with_index_types,
        vjp=_maxpool_vjp,
        reference=_maxpool,
        frontend=(
            Pattern("module", ("torch.nn.MaxPool2d",), _pool_module(Op.MAXPOOL2D)),
            Pattern("function", ("torch.nn.functional.max_pool2d",), _pool_function(Op.MAXPOOL2D)),
        ),
        lower={"tir": _tir("maxpool"), "c": "emit:_maxpool"},
        doc="max pooling; the second result is the argmax offset in its window",
    ),
    OpDef(
        Op.AVGPOOL2D,
        {**_POOL, "rid": -1},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.AVGPOOL2D_GRAD, no_saved),
        reference=_avgpool,
        frontend=(
            Pattern("module", ("torch.nn.AvgPool2d",), _pool_module(Op.AVGPOOL2D)),
            Pattern("function", ("torch.nn.functional.avg_pool2d",), _pool_function(Op.AVGPOOL2D)),
        ),
        lower={"tir": _tir("avgpool"), "c": "emit:_avgpool"},
        doc="average pooling (zero padding counted), divided exactly and rounded",
    ),
    OpDef(
        Op.GLOBAL_AVGPOOL,
        {"rid": -1},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.GLOBAL_AVGPOOL_GRAD, no_saved),
        reference=_gap,
        frontend=(
            Pattern("module", ("torch.nn.AdaptiveAvgPool2d",), _adaptive_module),
            Pattern("function", ("torch.nn.functional.adaptive_avg_pool2d",), _adaptive_function),
        ),
        lower={"tir": _tir("avgpool"), "c": "emit:_gap"},
        doc="mean over the spatial axes: [N, C, H, W] -> [N, C, 1, 1]",
    ),
    OpDef(
        Op.MAXPOOL2D_GRAD,
        {**_POOL, "rid": -1},
        reference=_maxpool_grad,
        lower={"tir": _tir("maxpool_grad"), "c": "emit:_maxpool_grad"},
        doc="dy scattered to the argmax of each window",
    ),
    OpDef(
        Op.AVGPOOL2D_GRAD,
        {**_POOL, "rid": -1},
        reference=_avgpool_grad,
        lower={"tir": _tir("avgpool_grad"), "c": "emit:_avgpool_grad"},
        doc="dy spread evenly over each window",
    ),
    OpDef(
        Op.GLOBAL_AVGPOOL_GRAD,
        {"rid": -1},
        reference=_gap_grad,
        lower={"tir": _tir("avgpool_grad"), "c": "emit:_gap_grad"},
        doc="dy spread evenly over the spatial axes",
    ),
)
