"""Helpers shared by the op definitions: result types, VJP shapes and reference-kernel plumbing.

Rules receive the pass or executor state duck-typed, so that this package imports neither the
passes, the executor nor torch:
- type rules get insert-mx-types' rewriter `r` (r.copy, r.b, r.env, r.rid(), r.ctx.bits);
- VJP rules get derive-backward's walker `w` (w.emit, w.type, w.needs, w.set_param_grad, w.g);
- reference rules get the executor's StepEnv (env.ctx, env.train, env.x, env.y, env.state, ...);
- frontend converters get the frontend context `c` (c.arg, c.emit, c.shape, c.param, c.describe).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mexc.arrangement import Arrangement
from mexc.ir import Node, Op, Value
from mexc.mx import MX, SITES_PER_NODE
from mexc.numerics import FixedScalar
from mexc.ops.registry import op_def
from mexc.types import Kind, TensorType, mx

Grads = list[Value | None]


# ----------------------------------------------------------------------------- result types


def mx_like(t: TensorType) -> TensorType:
    return mx(*t.shape)


def elementwise_types(r: Any, n: Node) -> None:
    """One MX result of the float result's shape."""
    r.copy(n, (mx_like(n.type),))


def with_index_types(r: Any, n: Node) -> None:
    """An MX result and an index result of the same shape (max-pool argmax, dropout mask)."""
    new = r.copy(n, (mx_like(n.type), TensorType(Kind.IDX, n.type.shape)))
    r.env[n.out] = new.out


def tir_rule(name: str) -> str:
    """The lowering key of an op's PlanRules method (mexc.lowering.step_plan)."""
    return f"step_plan:PlanRules.{name}"


# ----------------------------------------------------------------------------- VJP rules


def no_saved(n: Node) -> Value:
    return Value(-1)


def pointwise_vjp(grad_op: Op, saved: Callable[[Node], Value]) -> Callable[..., Grads]:
    """dx = grad_op(dy[, saved]) with the forward op's attributes (those grad_op has)."""

    def rule(w: Any, n: Node, dys: Grads) -> Grads:
        dy = dys[0]
        assert dy is not None
        if not w.needs[n.inputs[0]]:
            return [None]
        schema = op_def(grad_op).attrs
        a = {k: getattr(n.attrs, k) for k in schema if k != "rid" and hasattr(n.attrs, k)}
        ins = [dy] if saved is no_saved else [dy, saved(n)]
        return [w.emit(grad_op, ins, mx(*w.type(n.inputs[0]).shape), n.loc, **a).out]

    return rule


def pass_through(w: Any, n: Node, dys: Grads) -> Grads:
    """The gradient flows unchanged to the first input."""
    return [dys[0]]


# ----------------------------------------------------------------------------- reference rules


def tid(n: Node) -> int:
    """The node's first PRNG tensor id (rid * SITES_PER_NODE)."""
    return int(n.attrs.rid) * SITES_PER_NODE


def rows(x: MX) -> MX:
    """[..., K] -> [rows, K]: linear layers act on the last axis (tokens of a transformer)."""
    return MX(x.m.reshape(-1, x.m.shape[-1]), x.e)


def shape(n: Node) -> tuple[int, ...]:
    return tuple(n.type.shape)


def scalar(n: Node) -> FixedScalar:
    return FixedScalar.signed(float(n.attrs.value))


# ----------------------------------------------------------------------------- frontend


@dataclass(frozen=True)
class ParamView:
    """A parameter read through a reshape (timm's `x * self.gamma.reshape(1, -1, 1, 1)`): the
    get_attr node and the shape it is seen with; an op that takes parameters reads it."""

    source: Any
    shape: tuple[int, ...]


# the node meta key under which shape propagation records a Python number a node computed
# from shapes (x.size(-1), (w - x.shape[3]) % w): converters read it as a constant
STATIC_VALUE = "mexc_static_value"
# fx node meta key: the node belongs to a submodule the model keeps in eval mode while it trains
# (mexc.frontend_eval_modes); its converter drops nothing there
IN_EVAL_MODE = "mexc_in_eval_mode"


def called_name(n: Any) -> str:
    """The name of what a traced call calls: a method's ("add_"), a function's ("relu_",
    "linalg_vector_norm", "iadd"); "" for other nodes."""
    if n.op == "call_method":
        return str(n.target)
    return getattr(n.target, "__name__", "") if n.op == "call_function" else ""


def traced_dtype(n: Any) -> Any:
    """The dtype shape propagation recorded for n's tensor result, or None."""
    return getattr(n.meta.get("tensor_meta"), "dtype", None)


def is_float_tensor(n: Any) -> bool:
    """Shape propagation recorded a floating-point tensor as n's result."""
    dtype = traced_dtype(n)
    return dtype is not None and dtype.is_floating_point


def is_traced_tensor(n: Any) -> bool:
    """Shape propagation recorded a tensor as n's result (not a number, a tuple or None)."""
    return hasattr(n.meta.get("tensor_meta"), "shape")


def static_value(v: Any) -> Any:
    """v with every traced node that computed a number from shapes replaced by that number
    (inside tuples, lists and slices too); other nodes are left as they are."""
    if isinstance(v, (tuple, list)):
        return type(v)(static_value(x) for x in v)
    if isinstance(v, slice):
        return slice(static_value(v.start), static_value(v.stop), static_value(v.step))
    meta = getattr(v, "meta", None)
    if isinstance(meta, dict) and STATIC_VALUE in meta:
        return meta[STATIC_VALUE]
    return v


def finite_number(v: Any) -> bool:
    """v is a finite int or float (not a bool, a tensor or a traced node)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def static_int(v: Any) -> int:
    """A static integer argument of a traced call (dims, sizes, indices), a number or one
    computed from shapes."""
    from mexc.errors import UnsupportedOpError

    value = static_value(v)
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedOpError(
            f"expected a constant integer, got {v!r}, computed from tensor values; mexc "
            "compiles a static graph, whose sizes, dims and paddings come from shapes"
        )
    return int(value)


def single(v: Any, what: str) -> int:
    """The one int of a 1-D layer's stride, padding or kernel (an int or a 1-tuple)."""
    from mexc.errors import UnsupportedOpError

    v = static_value(v)
    if isinstance(v, str):
        raise UnsupportedOpError(f"string {what} {v!r} is not supported; give an integer")
    return static_int(v if isinstance(v, int) else v[0])


def as_rows(weight: Any) -> Arrangement:
    """A parameter held reshaped, its elements in their order: a 1-D layer's weight (O, C, k),
    or a transposed one's (C, O, k), as the (., ., 1, k) kernel of the 2-D layer it runs as; a
    LayerNorm's weight over several axes, flattened."""
    shape = tuple(int(d) for d in weight.shape)
    return Arrangement(shape, shape, tuple(range(len(shape))))


def pair(v: Any) -> tuple[int, int]:
    from mexc.errors import UnsupportedOpError

    v = static_value(v)
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, str):
        raise UnsupportedOpError(f"string padding {v!r} is not supported; give integers")
    return (static_int(v[0]), static_int(v[1]))


def unary_module(op: Op) -> Callable[..., Value]:
    def convert(c: Any, n: Any, m: Any) -> Value:
        return c.emit(op, [c.arg(n.args[0])], n)

    return convert


def unary_function(op: Op) -> Callable[..., Value]:
    def convert(c: Any, n: Any) -> Value:
        return c.emit(op, [c.arg(n.args[0])], n)

    return convert


# --- data parallel (OpDef.data_parallel / batch_partial callables; docs/distributed.md)


def keeps_batch_dim(n: Node) -> bool:
    """A concat or slice splits over data-parallel workers unless it works along the batch
    axis (a worker's rows would not be the rows of the whole result)."""
    dim, ndim = int(n.attrs.dim), len(n.type.shape)
    return dim % ndim != 0


def transposed_batch_axis(n: Node, x: TensorType, axis: int) -> int | None:
    """Where a transpose puts the input's batch axis."""
    return tuple(int(p) for p in n.attrs.perm).index(axis)


def sliced_batch_axis(n: Node, x: TensorType, axis: int) -> int | None:
    """A slice (or its gradient) keeps the batch axis, unless it cuts along it."""
    return None if int(n.attrs.dim) % len(x.shape) == axis else axis


def before_last(n: Node, axis: int) -> bool:
    """keeps_axes of an op along the last axis (a linear layer, softmax): a batch axis before
    it stays; on it the op would mix samples."""
    return axis < len(n.type.shape) - 1


def off_dim(n: Node, axis: int) -> bool:
    """keeps_axes of a concatenation: a batch axis other than its `dim` stays (as through a
    slice)."""
    return sliced_batch_axis(n, n.type, axis) is not None


def reshaped_batch_axis(n: Node, x: TensorType, axis: int) -> int | None:
    """A reshape keeps the rows of a batch whose axis is outermost in memory (every axis
    before it of extent 1): the result's batch axis is its first axis of extent above 1. A
    worker's rows are then one contiguous block of the whole tensor, before and after. A
    reshape of the axes after the batch only (the heads of a (T, N, D) sequence split, a
    flatten of (1, C, H, W)) keeps it where it is: each sample's elements move within it. A
    reshape of the axes before it only (a recurrent layer's stacked states [L D, N, H] seen as
    [L, D, N, H]) keeps the batch axis and those after it, at the end."""
    out = tuple(n.type.shape)
    if out[: axis + 1] == tuple(x.shape[: axis + 1]):  # a batch of one stays first too
        return axis
    tail = len(x.shape) - axis
    if axis > 0 and len(out) >= tail and out[len(out) - tail :] == tuple(x.shape[axis:]):
        return len(out) - tail
    if int(np.prod(x.shape[:axis], dtype=np.int64)) != 1:
        return None
    return next((j for j, d in enumerate(out) if d != 1), None)


def param_grad_share(n: Node, inputs: list[TensorType]) -> tuple[int, ...]:
    """mul_grad's result (the factor's gradient) is a worker's share of a sum over the batch
    when the factor is broadcast along the batch axis: a parameter, or any factor that is not
    batch-major."""
    x_shape = tuple(inputs[1].shape)
    g_shape = tuple(n.attrs.view or n.type.shape)
    pad = (1,) * (len(x_shape) - len(g_shape)) + g_shape
    return (0,) if bool(n.attrs.param) or pad[0] == 1 else ()


# F.max_pool*d's and F.avg_pool*d's positional parameters after (input, kernel, stride,
# padding), and the options their modules hold as attributes
POOL_POSITIONAL = {
    "max": ("dilation", "ceil_mode", "return_indices"),
    "avg": ("ceil_mode", "count_include_pad", "divisor_override"),
}
POOL_OPTIONS = ("ceil_mode", "count_include_pad", "divisor_override", "dilation", "return_indices")


def pool_call_arguments(n: Any, kind: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(kernel, stride, padding, options) of a traced F.max_pool2d / avg_pool2d call (`kind`
    "max" or "avg"; the 1-D forms too), positional or keyword."""
    kernel = n.args[1] if len(n.args) > 1 else n.kwargs["kernel_size"]
    stride = n.args[2] if len(n.args) > 2 else n.kwargs.get("stride")
    padding = n.args[3] if len(n.args) > 3 else n.kwargs.get("padding", 0)
    opts = dict(zip(POOL_POSITIONAL[kind], n.args[4:]))
    opts.update({k: v for k, v in n.kwargs.items() if k in POOL_OPTIONS})
    return kernel, stride, padding, opts
