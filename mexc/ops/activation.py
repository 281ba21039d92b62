"""Activations: ReLU (and PReLU), ReLU6, clamp / Hardtanh, LeakyReLU, Hardswish, Hardsigmoid,
sigmoid, SiLU, tanh, Mish, GELU, and ELU, CELU, SELU and Softplus as relu plus a table, and
their gradients."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.kernels._common import activation_qmax
from mexc.numerics import OFFSET_PARAM_RANGE
from mexc.ops.common import (
    Grads,
    called_name,
    elementwise_types,
    finite_number,
    pointwise_vjp,
    static_value,
    tid,
    tir_rule,
    unary_function,
    unary_module,
)
from mexc.ops.registry import OpDef, Pattern, define
from mexc.ops.tensor import (
    MAX_FILL,
    added,
    broadcast,
    broadcastable,
    detached,
    divided,
    folded_constant,
    is_boolean,
    is_fill,
    multiplied,
    number_added,
    scaled,
    sliced,
    subtracted,
)

_STEPS = {"sigmoid": Op.SIGMOID, "tanh": Op.TANH, "relu": Op.RELU}


def activated(c: Any, v: Value, shape: tuple[int, ...], kind: str) -> Value:
    """sigmoid, tanh or relu of v (a step of a decomposition: a recurrent layer's gates)."""
    return c.emit_as(_STEPS[kind], [v], shape)


def _relu_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    if n.id in w.masked_relus:
        return [dys[0]]  # the max pool after it already applied the mask
    return pointwise_vjp(Op.RELU_GRAD, lambda m: m.out)(w, n, dys)


def _abs(c: Any, n: Any) -> Value:
    return absolute(c, c.arg(n.args[0]), tuple(c.shape(n.args[0])))


def absolute(c: Any, x: Value, shape: tuple[int, ...]) -> Value:
    """|x| as relu(x) + relu(-x): exact (one exponent), and its gradient sign(x) dy (0 at 0,
    torch's) is the two ReLUs'."""
    pos = c.emit_as(Op.RELU, [x], shape)
    neg = c.emit_as(Op.RELU, [scaled(c, x, shape, -1.0)], shape)
    return added(c, pos, neg, shape)


def _softsign(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Softsign, F.softsign: x / (1 + |x|), a quotient of activations (`div`)."""
    x = n.args[0] if n.args else n.kwargs["input"]
    shape = tuple(c.shape(x))
    v = c.arg(x)
    return divided(c, n, v, number_added(c, n, absolute(c, v, shape), shape, 1.0))


# ----------------------------------------------------------------------------- masks


def _positive(c: Any, n: Any, d: Value, shape: tuple[int, ...], sign: float) -> Value:
    """The mask [sign d > 0] as 0 and 1: relu(e) / e of e = sign d detached (`detach`, `relu`,
    `div`), exact (m / m is 2^15 / 2^15; 0 / m and 0 / 0 are 0). No gradient flows into d, as
    in torch. One per (d, sign): the masks of a pair are made once, so `>` and `<=` of it are
    exactly complementary."""
    key = ("mask", d, sign)
    if key not in c.memo:
        e = detached(c, d if sign > 0 else scaled(c, d, shape, -1.0), shape)
        c.memo[key] = divided(c, n, activated(c, e, shape, "relu"), e)
    return c.memo[key]


def _one_minus(c: Any, n: Any, m: Value, shape: tuple[int, ...]) -> Value:
    return subtracted(c, n, 1.0, m, shape)


def _operand(c: Any, n: Any, v: Any, shape: tuple[int, ...], fill: bool = False) -> Value | float:
    """An activation broadcast to `shape`, or a finite number (a `fill`, which becomes part of
    the result, at most MAX_FILL in size: is_fill; a compared one may be larger, as only its
    difference's sign is read)."""
    if not c.is_node(v):
        value = static_value(v)
        if not (is_fill(value) if fill else finite_number(value)):
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"reads the number {value!r} beside activations; mexc takes finite numbers"
                    + (
                        f" of at most {MAX_FILL:g} in size here (a larger one would take the "
                        "result's one exponent from the activations)"
                        if fill
                        else ""
                    ),
                )
            )
        return float(value)
    if not isinstance(c.env.get(v), Value):  # a constant (a causal pattern, a buffer)
        held = folded_constant(c, n, v, shape, np.asarray)
        if held is not None:
            return held
    own = tuple(c.shape(v))
    if own != shape and not broadcastable(own, shape):
        raise UnsupportedOpError(
            c.describe(n, f"compares {list(own)} with a tensor of shape {list(shape)}")
        )
    return broadcast(c, n, c.arg(v), own, shape)


def _difference(c: Any, n: Any, a: Any, b: Any, shape: tuple[int, ...]) -> tuple[Value, float]:
    """(d, sign) with sign d = a - b, of an activation and an activation or a number (either
    side): d is made once per pair, whichever way round it is compared."""
    va, vb = _operand(c, n, a, shape), _operand(c, n, b, shape)
    if isinstance(va, float) and isinstance(vb, float):
        raise UnsupportedOpError(c.describe(n, "compares two numbers"))
    for key, sign in (((va, vb, shape), 1.0), ((vb, va, shape), -1.0)):
        if ("difference", *key) in c.memo:
            return c.memo[("difference", *key)], sign
    d = subtracted(c, n, va, vb, shape)
    c.memo[("difference", va, vb, shape)] = d
    return d, 1.0


_COMPARISONS = {"gt": "gt", "lt": "lt", "ge": "ge", "le": "le", "eq": "eq", "ne": "ne"}
_COMPARISONS |= {"greater": "gt", "less": "lt", "greater_equal": "ge", "less_equal": "le"}
_COMPARISONS |= {"__gt__": "gt", "__lt__": "lt", "__ge__": "ge", "__le__": "le"}


def _compare(c: Any, n: Any) -> Value:
    """a > b, a < b, >=, <=, ==, != of activations (or one and a number), as a mask of 0 and 1
    (an activation: torch.where, a product, .float() read it) from the masks [d > 0] and
    [-d > 0] of the difference d = a - b (_positive): a > b is [d > 0], a <= b is 1 - [d > 0],
    a == b is 1 - [d > 0] - [-d > 0]. The difference is rounded, so operands within its last
    place of each other may compare either way. No gradient flows into a and b, as in torch."""
    a, b = _operands(n)
    shape = tuple(c.shape(n))
    kind = _COMPARISONS[called_name(n)]
    d, sign = _difference(c, n, a, b, shape)
    above, below = _positive(c, n, d, shape, sign), _positive(c, n, d, shape, -sign)
    if kind in ("gt", "lt"):
        return above if kind == "gt" else below
    if kind in ("le", "ge"):
        return _one_minus(c, n, above if kind == "le" else below, shape)
    apart = added(c, above, below, shape)
    return apart if kind == "ne" else _one_minus(c, n, apart, shape)


def where_selected(c: Any, n: Any) -> Value:
    """torch.where(cond, x, y) with cond a mask of activations (_compare, or its logical ops):
    m x + (1 - m) y, x and y activations (broadcast) or numbers (fills); products by 0 and 1
    are exact, and the two parts meet in one sum (each element has one of them)."""
    names = ("input", "condition", "other") if n.op == "call_method" else ("condition", "input")
    args = dict(zip(names + ("other",), n.args)) | dict(n.kwargs)
    if args.get("input") is None:
        raise UnsupportedOpError(c.describe(n, "is torch.where(cond) (indices); give x and y"))
    return selected(c, n, args["condition"], args["input"], args["other"])


def selected(c: Any, n: Any, condition: Any, x: Any, y: Any) -> Value:
    """torch.where(condition, x, y) of fx arguments, n's result (also x.masked_fill(m, v): v
    where m, else x)."""
    shape = tuple(c.shape(n))
    _check_mask(c, n, condition)
    m = _operand(c, n, condition, shape)
    assert not isinstance(m, float)  # a boolean tensor
    parts = []
    for mask, v in ((m, x), (_one_minus(c, n, m, shape), y)):
        value = _operand(c, n, v, shape, fill=True)
        if isinstance(value, float):
            if value:
                parts.append(scaled(c, mask, shape, value))
        else:
            parts.append(multiplied(c, value, mask, shape))
    if not parts:
        return scaled(c, m, shape, 0.0)
    return parts[0] if len(parts) == 1 else added(c, parts[0], parts[1], shape)


def _check_mask(c: Any, n: Any, v: Any) -> None:
    """v is a boolean tensor (a comparison's mask): torch reads any other as nonzero-is-true,
    which 0/1 arithmetic on it would not compute."""
    if not (c.is_node(v) and is_boolean(v)):
        raise UnsupportedOpError(
            c.describe(
                n,
                "takes a logical op or a condition of a tensor that is not boolean; compare "
                "it first (x != 0)",
            )
        )


def _logical(c: Any, n: Any) -> Value:
    """~m, m1 & m2, m1 | m2 (and logical_not, logical_and, logical_or) of boolean masks:
    1 - m, m1 m2, m1 + m2 - m1 m2."""
    name = called_name(n)
    shape = tuple(c.shape(n))
    args = dict(zip(("input", "other"), n.args)) | dict(n.kwargs)
    first = args["input"]
    _check_mask(c, n, first)
    one = _operand(c, n, first, shape)
    assert not isinstance(one, float)
    if name in ("invert", "logical_not", "__invert__", "bitwise_not"):
        return _one_minus(c, n, one, shape)
    _check_mask(c, n, args.get("other"))
    two = _operand(c, n, args["other"], shape)
    assert not isinstance(two, float)
    both = multiplied(c, one, two, shape)
    if name in ("and_", "logical_and", "__and__", "bitwise_and"):
        return both
    return subtracted(c, n, added(c, one, two, shape), both, shape)


def _hardshrink(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Hardshrink, F.hardshrink: x [|x| > lambd], the mask of |x| - lambd (_positive)."""
    x, lambd = _shrink_args(c, n, m)
    shape, v = tuple(c.shape(x)), c.arg(x)
    beyond = number_added(c, n, absolute(c, v, shape), shape, -lambd)
    return multiplied(c, v, _positive(c, n, beyond, shape, 1.0), shape)


def _threshold(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Threshold(threshold, value), F.threshold(x, threshold, value): x where x > threshold,
    else value: m x + (1 - m) value with m = [x - threshold > 0] (_positive); the value at
    most MAX_FILL in size (is_fill), as torch.where's."""
    names = ("input", "threshold", "value")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    x = args["input"]
    level = static_value(m.threshold if m is not None else args["threshold"])
    value = static_value(m.value if m is not None else args["value"])
    if not finite_number(level) or not is_fill(value):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"thresholds at {level!r} with the value {value!r}; mexc takes a finite "
                f"threshold and a value of at most {MAX_FILL:g} in size",
            )
        )
    shape, v = tuple(c.shape(x)), c.arg(x)
    mask = _positive(c, n, number_added(c, n, v, shape, -float(level)), shape, 1.0)
    kept = multiplied(c, v, mask, shape)
    if not value:
        return kept
    return added(c, kept, scaled(c, _one_minus(c, n, mask, shape), shape, float(value)), shape)


def elementwise_extreme(c: Any, n: Any, a: Any, b: Any, largest: bool) -> Value:
    """torch.maximum(a, b) as b + relu(a - b), torch.minimum(a, b) as a - relu(a - b), for two
    activations of one shape: integer sums and a ReLU, each rounded as docs/numerics.md says
    (so the result is the larger or smaller one up to those roundings), and the gradient goes
    to the side the ReLU's mask picks (at a tie all of it to b for the maximum, to a for the
    minimum, where torch gives each half)."""
    shape = tuple(c.shape(n))
    if not (c.is_node(a) and c.is_node(b)) or any(tuple(c.shape(v)) != shape for v in (a, b)):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"takes the elementwise {'maximum' if largest else 'minimum'} of operands that "
                "are not two activations of the result's shape; broadcast them first, or use "
                "clamp for a constant bound",
            )
        )
    va, vb = c.arg(a), c.arg(b)
    gap = c.emit_as(Op.RELU, [subtracted(c, n, va, vb, shape)], shape)
    if largest:
        return added(c, vb, gap, shape)
    return subtracted(c, n, va, gap, shape)


def _operands(n: Any) -> tuple[Any, Any]:
    args = dict(zip(("input", "other"), n.args)) | dict(n.kwargs)
    return args["input"], args.get("other")


def _maximum(c: Any, n: Any) -> Value:
    return elementwise_extreme(c, n, *_operands(n), True)


def _minimum(c: Any, n: Any) -> Value:
    return elementwise_extreme(c, n, *_operands(n), False)


def _glu(c: Any, n: Any, x: Any, dim: int) -> Value:
    """GLU: the first half of x along `dim` times the sigmoid of the second half (torch's
    order), as a slice of each half, SIGMOID and MUL: the integer sigmoid and product, with
    their gradients. (An axis of odd size, or out of range, torch refuses at tracing.)"""
    shape = tuple(c.shape(x))
    axis = dim % len(shape)
    if axis == c.batch_axis(c.arg(x)):
        raise UnsupportedOpError(c.describe(n, "applies GLU along the batch axis"))
    half = shape[axis] // 2
    v = c.arg(x)
    a = sliced(c, v, shape, axis, 0, half)
    gate = activated(c, sliced(c, v, shape, axis, half, 2 * half), tuple(c.shape(n)), "sigmoid")
    return c.emit(Op.MUL, [a, gate], n)


def _glu_module(c: Any, n: Any, m: Any) -> Value:
    return _glu(c, n, n.args[0], int(m.dim))


def _glu_function(c: Any, n: Any) -> Value:
    args = dict(zip(("input", "dim"), n.args)) | dict(n.kwargs)
    return _glu(c, n, args["input"], int(args.get("dim", -1)))


def _gelu_module(c: Any, n: Any, m: Any) -> Value:
    """nn.GELU, exact or approximate="tanh": the tanh form's x Phi(x) is within 5.2e-4 of the
    exact one on Phi's table range (docs/numerics.md section 9), below an int8 step of any
    output above 0.07, so both lower to the one integer GELU."""
    if m.approximate not in ("none", "tanh"):
        raise UnsupportedOpError(c.describe(n, f"uses GELU approximate={m.approximate!r}"))
    return c.emit(Op.GELU, [c.arg(n.args[0])], n)


def _clamp(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.clamp_forward(a[0], *K.clamp_bounds(n.attrs), activation_qmax(env.ctx)),)


def _clamp_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.clamp_backward(a[0], a[1], *K.clamp_bounds(n.attrs)),)


def _emit_clamp(c: Any, n: Any, x: Any, lo: Any, hi: Any) -> Value:
    """A clamp between Python numbers (None: no bound)."""
    for bound in (lo, hi):
        if bound is not None and (c.is_node(bound) or not isinstance(bound, (int, float))):
            raise UnsupportedOpError(
                c.describe(n, "clamps to a tensor; mexc takes constant bounds (numbers)")
            )
        if bound is not None:
            try:
                K.clamp_bound(float(bound))
            except ValueError:
                raise UnsupportedOpError(
                    c.describe(n, f"clamps to {bound!r}; bounds must be finite and below 2^15")
                ) from None
    if lo is None and hi is None:
        return c.arg(x)
    return c.emit(
        Op.CLAMP,
        [c.arg(x)],
        n,
        lo=float(lo or 0.0),
        hi=float(hi or 0.0),
        has_lo=lo is not None,
        has_hi=hi is not None,
    )


def _clamp_call(c: Any, n: Any) -> Value:
    """torch.clamp / clip (function or method): min and max, positional or by name."""
    args = dict(zip(("input", "min", "max"), n.args)) | dict(n.kwargs)
    return _emit_clamp(c, n, args["input"], args.get("min"), args.get("max"))


def _clamp_min(c: Any, n: Any) -> Value:
    v = n.args[1] if len(n.args) > 1 else n.kwargs["min"]
    return _emit_clamp(c, n, n.args[0], v, None)


def _clamp_max(c: Any, n: Any) -> Value:
    v = n.args[1] if len(n.args) > 1 else n.kwargs["max"]
    return _emit_clamp(c, n, n.args[0], None, v)


def _hardtanh_module(c: Any, n: Any, m: Any) -> Value:
    return _emit_clamp(c, n, n.args[0], float(m.min_val), float(m.max_val))


def _hardtanh_function(c: Any, n: Any) -> Value:
    args = dict(zip(("input", "min_val", "max_val"), n.args)) | dict(n.kwargs)
    lo, hi = float(args.get("min_val", -1.0)), float(args.get("max_val", 1.0))
    return _emit_clamp(c, n, args["input"], lo, hi)


def _leaky_saved(n: Node) -> Value:
    """The output (its sign is the input's) for a slope >= 0, the input for a negative one:
    the output of an unchanged input is usually kept for the next layer anyway."""
    return n.out if float(n.attrs.slope) >= 0 else n.inputs[0]


def _leaky_slope(c: Any, n: Any, slope: Any) -> float:
    try:
        K.leaky_slope(float(slope))
    except (TypeError, ValueError):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"is a LeakyReLU with slope {slope!r}; the integer form takes a finite constant "
                "slope of magnitude below 2^15",
            )
        ) from None
    return float(slope)


def _leaky_module(c: Any, n: Any, m: Any) -> Value:
    slope = _leaky_slope(c, n, m.negative_slope)
    return c.emit(Op.LEAKY_RELU, [c.arg(n.args[0])], n, slope=slope)


def _leaky_function(c: Any, n: Any) -> Value:
    slope = n.args[1] if len(n.args) > 1 else n.kwargs.get("negative_slope", 0.01)
    return c.emit(Op.LEAKY_RELU, [c.arg(n.args[0])], n, slope=_leaky_slope(c, n, slope))


def _leaky_relu(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.leaky_relu_forward(a[0], float(n.attrs.slope), env.ctx, tid(n)),)


def _leaky_relu_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.leaky_relu_backward(a[0], a[1], float(n.attrs.slope), env.ctx, tid(n)),)


def _relu(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.relu_forward(a[0]),)


def _relu6(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.relu6_forward(a[0]),)


def _relu_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.relu_backward(a[0], a[1]),)


def _relu6_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.relu6_backward(a[0], a[1]),)


def _gelu(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.gelu_forward(a[0], env.ctx, tid(n)),)


def _gelu_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.gelu_backward(a[0], a[1], env.ctx, tid(n)),)


def _hardswish(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.hardswish_forward(a[0], env.ctx, tid(n)),)


def _hardswish_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.hardswish_backward(a[0], a[1], env.ctx, tid(n)),)


def _hardsigmoid(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.hardsigmoid_forward(a[0], env.ctx, tid(n)),)


def _hardsigmoid_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.hardsigmoid_backward(a[0], a[1], env.ctx, tid(n)),)


def _sigmoid(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.sigmoid_forward(a[0], env.ctx, tid(n)),)


def _sigmoid_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.sigmoid_backward(a[0], a[1], env.ctx, tid(n)),)


def _silu(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.silu_forward(a[0], env.ctx, tid(n)),)


def _silu_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.silu_backward(a[0], a[1], env.ctx, tid(n)),)


def _tanh(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.tanh_forward(a[0], env.ctx, tid(n)),)


def _tanh_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.tanh_backward(a[0], a[1], env.ctx, tid(n)),)


def _mish(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.mish_forward(a[0], env.ctx, tid(n)),)


def _mish_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.mish_backward(a[0], a[1], env.ctx, tid(n)),)


def _offset(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    fn, params = str(n.attrs.fn), tuple(n.attrs.params)
    return (K.offset_forward(a[0], fn, params, env.ctx, tid(n)),)


def _offset_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    fn, params = str(n.attrs.fn), tuple(n.attrs.params)
    return (K.offset_backward(a[0], a[1], fn, params, env.ctx, tid(n)),)


def _offset_param(c: Any, n: Any, what: str, v: Any) -> float:
    lo, hi = OFFSET_PARAM_RANGE
    if c.is_node(v) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
        raise UnsupportedOpError(
            c.describe(n, f"has {what} {v!r}; mexc takes a constant {what} in [2^-8, 2^8]")
        )
    return float(v)


def _relu_plus_offset(
    c: Any, n: Any, x: Any, fn: str, params: tuple[float, ...], scale: float | None = None
) -> Value:
    """relu(x) + offset(x), times `scale` where one is given (docs/layers.md)."""
    return _relu_plus_offset_of(c, n, c.arg(x), fn, params, scale)


def _relu_plus_offset_of(
    c: Any, n: Any, xv: Value, fn: str, params: tuple[float, ...], scale: float | None = None
) -> Value:
    shape = c.shape(n)
    relu = c.emit_as(Op.RELU, [xv], shape)
    offset = c.emit_as(Op.ACTIVATION_OFFSET, [xv], shape, fn=fn, params=params)
    if scale is None:
        return c.emit(Op.ADD, [relu, offset], n)
    return scaled(c, c.emit_as(Op.ADD, [relu, offset], shape), shape, scale)


def _args(n: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return dict(zip(names, n.args)) | dict(n.kwargs)


def _alpha_module(fn: str) -> Callable[..., Value]:
    """The converter of nn.ELU or nn.CELU (fn "elu" or "celu"): its alpha."""

    def convert(c: Any, n: Any, m: Any) -> Value:
        alpha = _offset_param(c, n, "alpha", m.alpha)
        return _relu_plus_offset(c, n, n.args[0], fn, (alpha,))

    return convert


def _alpha_function(fn: str) -> Callable[..., Value]:
    """The converter of F.elu or F.celu(input, alpha=1.0)."""

    def convert(c: Any, n: Any) -> Value:
        a = _args(n, ("input", "alpha"))
        alpha = _offset_param(c, n, "alpha", a.get("alpha", 1.0))
        return _relu_plus_offset(c, n, a["input"], fn, (alpha,))

    return convert


# torch's SELU constants (torch.nn.SELU): selu(x) = SELU_SCALE elu(x, SELU_ALPHA)
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _selu_module(c: Any, n: Any, m: Any) -> Value:
    return _relu_plus_offset(c, n, n.args[0], "elu", (SELU_ALPHA,), SELU_SCALE)


def _selu_function(c: Any, n: Any) -> Value:
    return _relu_plus_offset(c, n, n.args[0], "elu", (SELU_ALPHA,), SELU_SCALE)


def _softplus_params(c: Any, n: Any, beta: Any, threshold: Any) -> tuple[float, float]:
    if (
        c.is_node(threshold)
        or not isinstance(threshold, (int, float))
        or not math.isfinite(threshold)
        or threshold <= 0
    ):
        raise UnsupportedOpError(
            c.describe(n, f"has threshold {threshold!r}; mexc takes a positive constant")
        )
    return (_offset_param(c, n, "beta", beta), float(threshold))


def _log_sigmoid(c: Any, n: Any, m: Any = None) -> Value:
    """nn.LogSigmoid, F.logsigmoid: -softplus(-x), the softplus of docs/layers.md (beta 1,
    threshold 20) of -x, scaled by -1."""
    x = n.args[0] if n.args else n.kwargs["input"]
    neg = scaled(c, c.arg(x), tuple(c.shape(x)), -1.0)
    return _relu_plus_offset_of(c, n, neg, "softplus", (1.0, 20.0), -1.0)


def _softshrink(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Softshrink, F.softshrink: x - clamp(x, -lambd, lambd), exact at x's exponent (the
    clamp's bounds are on its grid)."""
    x, bound = _shrink_args(c, n, m)
    shape, xv = tuple(c.shape(x)), c.arg(x)
    inner = c.emit_as(Op.CLAMP, [xv], shape, lo=-bound, hi=bound, has_lo=True, has_hi=True)
    return subtracted(c, n, xv, inner, shape)


def _shrink_args(c: Any, n: Any, m: Any) -> tuple[Any, float]:
    """The input and lambd of nn.Softshrink / nn.Hardshrink (m) or their functions."""
    args = dict(zip(("input", "lambd"), n.args)) | dict(n.kwargs)
    lambd = m.lambd if m is not None else static_value(args.get("lambd", 0.5))
    if not finite_number(lambd) or lambd < 0:
        raise UnsupportedOpError(
            c.describe(n, f"has lambd {lambd!r}; mexc takes a constant lambd >= 0")
        )
    return args["input"], float(lambd)


def _softplus_module(c: Any, n: Any, m: Any) -> Value:
    params = _softplus_params(c, n, m.beta, m.threshold)
    return _relu_plus_offset(c, n, n.args[0], "softplus", params)


def _softplus_function(c: Any, n: Any) -> Value:
    a = _args(n, ("input", "beta", "threshold"))
    params = _softplus_params(c, n, a.get("beta", 1.0), a.get("threshold", 20.0))
    return _relu_plus_offset(c, n, a["input"], "softplus", params)


def _prelu(c: Any, n: Any, x: Any, weight: Value, count: int) -> Value:
    """PReLU(x) = relu(x) + a min(x, 0), a per channel (axis 1) or one for all: a clamp, a
    multiplication by the parameter (trained as a layer scale is) and an addition. torch has
    checked that count is 1 or the channels' when the example ran."""
    shape = c.shape(n)
    view = (1,) * len(shape) if count == 1 else (1, count) + (1,) * (len(shape) - 2)
    xv = c.arg(x)
    relu = c.emit_as(Op.RELU, [xv], shape)
    negative = c.emit_as(Op.CLAMP, [xv], shape, lo=0.0, hi=0.0, has_lo=False, has_hi=True)
    scaled = c.emit_as(Op.MUL, [negative, weight], shape, view=view)
    return c.emit(Op.ADD, [relu, scaled], n)


def _prelu_module(c: Any, n: Any, m: Any) -> Value:
    weight = c.param(f"{n.target}.weight", m.weight, "scale")
    return _prelu(c, n, n.args[0], weight, int(m.weight.numel()))


def _prelu_function(c: Any, n: Any) -> Value:
    a = _args(n, ("input", "weight"))
    if not c.is_param(a["weight"]):
        raise UnsupportedOpError(c.describe(n, "needs its weight to be a module parameter"))
    count = int(c.fetch(a["weight"]).numel())
    return _prelu(c, n, a["input"], c.get_param(a["weight"], "scale"), count)


# lo, hi: the bounds (has_lo / has_hi: present)
_CLAMP_ATTRS = {"lo": 0.0, "hi": 0.0, "has_lo": True, "has_hi": True}


define(
    OpDef(
        Op.RELU,
        {},
        types=elementwise_types,
        keeps_axes=True,
        vjp=_relu_vjp,
        reference=_relu,
        frontend=(
            Pattern("module", ("torch.nn.ReLU",), unary_module(Op.RELU)),
            Pattern(
                "function",
                ("torch.relu", "torch.nn.functional.relu"),
                unary_function(Op.RELU),
            ),
            Pattern("method", ("relu",), unary_function(Op.RELU)),
            Pattern("function", ("torch.abs",), _abs),
            Pattern("method", ("abs",), _abs),
            Pattern("function", ("torch.nn.functional.softsign",), _softsign),
            Pattern("module", ("torch.nn.Hardshrink",), _hardshrink),
            Pattern("module", ("torch.nn.Threshold",), _threshold),
            Pattern("function", ("torch.nn.functional.threshold",), _threshold),
            Pattern("function", ("torch.nn.functional.hardshrink",), _hardshrink),
            Pattern(
                "function",
                tuple(f"operator.{k}" for k in ("gt", "lt", "ge", "le", "eq", "ne"))
                + tuple(f"torch.{k}" for k in _COMPARISONS if not k.startswith("_")),
                _compare,
            ),
            Pattern("method", tuple(_COMPARISONS), _compare),
            Pattern(
                "function",
                ("operator.invert", "operator.and_", "operator.or_")
                + ("torch.logical_not", "torch.logical_and", "torch.logical_or"),
                _logical,
            ),
            Pattern("method", ("logical_not", "logical_and", "logical_or"), _logical),
            Pattern("module", ("torch.nn.Softsign",), _softsign),
            Pattern("function", ("torch.maximum",), _maximum),
            Pattern("method", ("maximum",), _maximum),
            Pattern("function", ("torch.minimum",), _minimum),
            Pattern("method", ("minimum",), _minimum),
            Pattern("module", ("torch.nn.PReLU",), _prelu_module),
            Pattern("function", ("torch.nn.functional.prelu", "torch.prelu"), _prelu_function),
        ),
        lower={"tir": tir_rule("relu"), "c": "emit:_relu"},
        in_place=True,
        doc="max(x, 0) on mantissas; the exponent is kept",
        data_parallel=True,
    ),
    OpDef(
        Op.RELU6,
        {},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.RELU6_GRAD, lambda n: n.out),
        reference=_relu6,
        frontend=(
            Pattern("module", ("torch.nn.ReLU6",), unary_module(Op.RELU6)),
            Pattern("function", ("torch.nn.functional.relu6",), unary_function(Op.RELU6)),
        ),
        lower={"tir": tir_rule("relu6"), "c": "emit:_relu6"},
        in_place=True,
        doc="min(max(x, 0), 6) with 6 at the input's exponent",
        data_parallel=True,
    ),
    OpDef(
        Op.CLAMP,
        _CLAMP_ATTRS,
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.CLAMP_GRAD, lambda n: n.inputs[0]),
        reference=_clamp,
        frontend=(
            Pattern("module", ("torch.nn.Softshrink",), _softshrink),
            Pattern("function", ("torch.nn.functional.softshrink",), _softshrink),
            Pattern("function", ("torch.clamp", "torch.clip"), _clamp_call),
            Pattern("method", ("clamp", "clip"), _clamp_call),
            Pattern("function", ("torch.clamp_min",), _clamp_min),
            Pattern("method", ("clamp_min",), _clamp_min),
            Pattern("function", ("torch.clamp_max",), _clamp_max),
            Pattern("method", ("clamp_max",), _clamp_max),
            Pattern("module", ("torch.nn.Hardtanh",), _hardtanh_module),
            Pattern(
                "function",
                ("torch.nn.functional.hardtanh", "torch.nn.functional.hardtanh_"),
                _hardtanh_function,
            ),
        ),
        lower={"tir": tir_rule("clamp"), "c": "emit:_clamp"},
        in_place=True,
        doc="min(max(x, lo), hi) on mantissas with the bounds at the input's exponent",
        data_parallel=True,
    ),
    OpDef(
        Op.LEAKY_RELU,
        {"slope": 0.01, "rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.LEAKY_RELU_GRAD, _leaky_saved),
        reference=_leaky_relu,
        frontend=(
            Pattern("module", ("torch.nn.LeakyReLU",), _leaky_module),
            Pattern(
                "function",
                ("torch.nn.functional.leaky_relu", "torch.nn.functional.leaky_relu_"),
                _leaky_function,
            ),
        ),
        lower={"tir": tir_rule("leaky_relu"), "c": "emit:_leaky_relu"},
        doc="x where x > 0, else slope x (slope as num 2^-S), one compaction (docs/layers.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.GELU,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.GELU_GRAD, lambda n: n.inputs[0]),
        reference=_gelu,
        frontend=(
            Pattern("module", ("torch.nn.GELU",), _gelu_module),
            Pattern("function", ("torch.nn.functional.gelu",), unary_function(Op.GELU)),
        ),
        lower={"tir": tir_rule("gelu"), "c": "emit:_gelu"},
        doc="exact GELU as x times Phi(x) from an integer table (docs/numerics.md section 9)",
        data_parallel=True,
    ),
    OpDef(
        Op.HARDSWISH,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.HARDSWISH_GRAD, lambda n: n.inputs[0]),
        reference=_hardswish,
        frontend=(
            Pattern("module", ("torch.nn.Hardswish",), unary_module(Op.HARDSWISH)),
            Pattern("function", ("torch.nn.functional.hardswish",), unary_function(Op.HARDSWISH)),
        ),
        lower={"tir": tir_rule("hardswish"), "c": "emit:_hardswish"},
        doc="x relu6(x + 3) / 6, exact on the 2^-16 grid, one division by 6 (docs/layers.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.HARDSIGMOID,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.HARDSIGMOID_GRAD, lambda n: n.inputs[0]),
        reference=_hardsigmoid,
        frontend=(
            Pattern("module", ("torch.nn.Hardsigmoid",), unary_module(Op.HARDSIGMOID)),
            Pattern(
                "function", ("torch.nn.functional.hardsigmoid",), unary_function(Op.HARDSIGMOID)
            ),
        ),
        lower={"tir": tir_rule("hardsigmoid"), "c": "emit:_hardsigmoid"},
        doc="relu6(x + 3) / 6 on hardswish's grid, one division by 6 (docs/layers.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.SIGMOID,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.SIGMOID_GRAD, lambda n: n.inputs[0]),
        reference=_sigmoid,
        frontend=(
            Pattern("module", ("torch.nn.Sigmoid",), unary_module(Op.SIGMOID)),
            Pattern(
                "function",
                ("torch.sigmoid", "torch.nn.functional.sigmoid"),
                unary_function(Op.SIGMOID),
            ),
            Pattern("method", ("sigmoid",), unary_function(Op.SIGMOID)),
            Pattern("module", ("torch.nn.GLU",), _glu_module),
            Pattern("function", ("torch.nn.functional.glu",), _glu_function),
        ),
        lower={"tir": tir_rule("sigmoid"), "c": "emit:_sigmoid"},
        doc="the logistic function through an integer table at 2^-15 (docs/layers.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.SILU,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.SILU_GRAD, lambda n: n.inputs[0]),
        reference=_silu,
        frontend=(
            Pattern("module", ("torch.nn.SiLU",), unary_module(Op.SILU)),
            Pattern("function", ("torch.nn.functional.silu",), unary_function(Op.SILU)),
        ),
        lower={"tir": tir_rule("silu"), "c": "emit:_silu"},
        doc="x sigmoid(x): the mantissa times the sigmoid table, one compaction",
        data_parallel=True,
    ),
    OpDef(
        Op.TANH,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.TANH_GRAD, lambda n: n.inputs[0]),
        reference=_tanh,
        frontend=(
            Pattern("module", ("torch.nn.Tanh",), unary_module(Op.TANH)),
            Pattern(
                "function",
                ("torch.tanh", "torch.nn.functional.tanh"),
                unary_function(Op.TANH),
            ),
            Pattern("method", ("tanh",), unary_function(Op.TANH)),
        ),
        lower={"tir": tir_rule("tanh"), "c": "emit:_tanh"},
        doc="tanh through an integer table at 2^-15 (docs/numerics.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.MISH,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.MISH_GRAD, lambda n: n.inputs[0]),
        reference=_mish,
        frontend=(
            Pattern("module", ("torch.nn.Mish",), unary_module(Op.MISH)),
            Pattern("function", ("torch.nn.functional.mish",), unary_function(Op.MISH)),
        ),
        lower={"tir": tir_rule("mish"), "c": "emit:_mish"},
        doc="x tanh(softplus(x)): the mantissa times a table, one compaction (as SiLU)",
        data_parallel=True,
    ),
    OpDef(
        Op.TANH_GRAD,
        {"rid": -1},
        reference=_tanh_grad,
        lower={"tir": tir_rule("tanh_grad"), "c": "emit:_tanh_grad"},
        doc="dy (1 - tanh(x)^2) through a table",
        data_parallel=True,
    ),
    OpDef(
        Op.ACTIVATION_OFFSET,
        {"fn": "elu", "params": (1.0,), "rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.ACTIVATION_OFFSET_GRAD, lambda n: n.inputs[0]),
        reference=_offset,
        frontend=(
            Pattern("module", ("torch.nn.ELU",), _alpha_module("elu")),
            Pattern(
                "function",
                ("torch.nn.functional.elu", "torch.nn.functional.elu_"),
                _alpha_function("elu"),
            ),
            Pattern("module", ("torch.nn.CELU",), _alpha_module("celu")),
            Pattern(
                "function",
                ("torch.nn.functional.celu", "torch.nn.functional.celu_"),
                _alpha_function("celu"),
            ),
            Pattern("module", ("torch.nn.SELU",), _selu_module),
            Pattern(
                "function",
                ("torch.nn.functional.selu", "torch.nn.functional.selu_", "torch.selu"),
                _selu_function,
            ),
            Pattern("module", ("torch.nn.Softplus",), _softplus_module),
            Pattern("function", ("torch.nn.functional.softplus",), _softplus_function),
            Pattern("module", ("torch.nn.LogSigmoid",), _log_sigmoid),
            Pattern("function", ("torch.nn.functional.logsigmoid",), _log_sigmoid),
        ),
        lower={"tir": tir_rule("activation_offset"), "c": "emit:_activation_offset"},
        doc="the offset of relu(x) + offset(x) (ELU, CELU, SELU, Softplus): a table of x, "
        "compacted (docs/layers.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.ACTIVATION_OFFSET_GRAD,
        {"fn": "elu", "params": (1.0,), "rid": -1},
        reference=_offset_grad,
        lower={"tir": tir_rule("activation_offset_grad"), "c": "emit:_activation_offset_grad"},
        doc="dy offset'(x) through the derivative's table",
        data_parallel=True,
    ),
    OpDef(
        Op.MISH_GRAD,
        {"rid": -1},
        reference=_mish_grad,
        lower={"tir": tir_rule("mish_grad"), "c": "emit:_mish_grad"},
        doc="dy Mish'(x) through a table",
        data_parallel=True,
    ),
    OpDef(
        Op.RELU_GRAD,
        {},
        reference=_relu_grad,
        lower={"tir": tir_rule("relu_grad"), "c": "emit:_relu_grad"},
        in_place=True,
        doc="dy masked by the ReLU output's sign",
        data_parallel=True,
    ),
    OpDef(
        Op.RELU6_GRAD,
        {},
        reference=_relu6_grad,
        lower={"tir": tir_rule("relu6_grad"), "c": "emit:_relu6_grad"},
        in_place=True,
        doc="dy masked where the ReLU6 output is strictly inside (0, 6)",
        data_parallel=True,
    ),
    OpDef(
        Op.CLAMP_GRAD,
        _CLAMP_ATTRS,
        reference=_clamp_grad,
        lower={"tir": tir_rule("clamp_grad"), "c": "emit:_clamp_grad"},
        in_place=True,
        doc="dy where lo < x < hi strictly (torch's clamp and Hardtanh gradients), else 0",
        data_parallel=True,
    ),
    OpDef(
        Op.LEAKY_RELU_GRAD,
        {"slope": 0.01, "rid": -1},
        reference=_leaky_relu_grad,
        lower={"tir": tir_rule("leaky_relu_grad"), "c": "emit:_leaky_relu_grad"},
        doc="dy where the saved output (or, for a negative slope, input) is > 0, else slope dy",
        data_parallel=True,
    ),
    OpDef(
        Op.HARDSWISH_GRAD,
        {"rid": -1},
        reference=_hardswish_grad,
        lower={"tir": tir_rule("hardswish_grad"), "c": "emit:_hardswish_grad"},
        doc="dy (2x + 3) / 6 inside (-3, 3), dy above, 0 below",
        data_parallel=True,
    ),
    OpDef(
        Op.HARDSIGMOID_GRAD,
        {"rid": -1},
        reference=_hardsigmoid_grad,
        lower={"tir": tir_rule("hardsigmoid_grad"), "c": "emit:_hardsigmoid_grad"},
        doc="dy / 6 strictly inside (-3, 3), else 0",
        data_parallel=True,
    ),
    OpDef(
        Op.SIGMOID_GRAD,
        {"rid": -1},
        reference=_sigmoid_grad,
        lower={"tir": tir_rule("sigmoid_grad"), "c": "emit:_sigmoid_grad"},
        doc="dy sigmoid'(x) through a table",
        data_parallel=True,
    ),
    OpDef(
        Op.SILU_GRAD,
        {"rid": -1},
        reference=_silu_grad,
        lower={"tir": tir_rule("silu_grad"), "c": "emit:_silu_grad"},
        doc="dy SiLU'(x) through a table",
        data_parallel=True,
    ),
    OpDef(
        Op.GELU_GRAD,
        {"rid": -1},
        reference=_gelu_grad,
        lower={"tir": tir_rule("gelu_grad"), "c": "emit:_gelu_grad"},
        doc="dy times GELU'(x) through a lookup table",
        data_parallel=True,
    ),
)
