"""Normalization: batch norm (with its running statistics) and layer norm."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import InputError, UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.numerics import FixedScalar
from mexc.ops.common import (
    Grads,
    as_rows,
    before_last,
    called_name,
    finite_number,
    is_traced_tensor,
    mx_like,
    static_int,
    static_value,
    tid,
)
from mexc.ops.gather import is_gathered
from mexc.ops.registry import OpDef, Pattern, define, op_def
from mexc.ops.tensor import (
    ACTIVATION_DIVISORS,
    as_result,
    concatenated,
    mean_over,
    multiplied,
    reshaped,
    scaled,
    sliced,
    transposed,
)
from mexc.types import Exp, Kind, TensorType, acc, mx


def _batchnorm_types(r: Any, n: Node) -> None:
    c = n.type.shape[1]
    # results: y, saved normalized input (xhat), batch statistics (mean, var) per channel
    stats = TensorType(Kind.ACC, (2, c), Exp.AXIS0)
    new = r.copy(n, (mx_like(n.type), mx_like(n.type), stats))
    r.env[n.out] = new.out


def _layernorm_types(r: Any, n: Node) -> None:
    # results: y and the saved normalized input (xhat) for the backward pass
    new = r.copy(n, (mx_like(n.type), mx_like(n.type)))
    r.env[n.out] = new.out


def _batchnorm_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, gamma, beta = n.inputs[0], n.inputs[1], n.inputs[2]
    c = w.type(gamma).shape
    node = w.emit(
        Op.BATCHNORM_GRAD,
        [dy, n.result(1), n.result(2), gamma],
        (mx(*w.type(x).shape), acc(*c), acc(*c)),
        n.loc,
    )
    w.set_param_grad(gamma, node.result(1), n)
    w.set_param_grad(beta, node.result(2), n)
    return [node.result(0) if w.needs[x] else None, None, None, None, None]


def _row_norm(n: Node, axis: int) -> bool:
    """A LayerNorm of each row along the last axis keeps a batch axis before the last;
    GroupNorm, whose rows span the axes after the first, only a batch axis first."""
    if int(n.attrs.groups) == 1 and int(n.attrs.per) == 1:
        return before_last(n, axis)
    return axis == 0


def _layernorm_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, gamma, beta = n.inputs
    d = w.type(gamma).shape
    node = w.emit(
        Op.LAYERNORM_GRAD,
        [dy, n.result(1), gamma],
        (mx(*w.type(x).shape), acc(*d), acc(*d)),
        n.loc,
        groups=int(n.attrs.groups),
        per=int(n.attrs.per),
    )
    dgamma = w.weight_grad(gamma, node.result(1), n)  # a gain times a number: it goes on
    w.set_param_grad(beta, node.result(2), n)
    return [node.result(0) if w.needs[x] else None, dgamma, None]


def _running_update(b: Any, g: Any, bn: Node, rid: int) -> list[tuple[str, Value]]:
    """BN_RUNNING_UPDATE of the running mean and variance from the batch statistics."""
    rm, rv = bn.inputs[3], bn.inputs[4]
    upd = b.add(
        Op.BN_RUNNING_UPDATE,
        [rm, rv, bn.result(2)],
        (g.type_of(rm), g.type_of(rv)),
        op_def(Op.BN_RUNNING_UPDATE).make(momentum=bn.attrs.momentum, rid=rid),
        bn.loc,
    )
    return [(f"state:{g.node(v.node).attrs.name}", upd.result(i)) for i, v in enumerate((rm, rv))]


def _batchnorm(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    x, gamma, beta, rmean, rvar = a
    if env.train:
        y, saved = K.batchnorm_forward_train(x, gamma, beta, float(n.attrs.eps), env.ctx, tid(n))
        return (y, saved, saved)
    y = K.batchnorm_forward_eval(
        x, gamma, beta, rmean, rvar, env.ctx, tid(n), eps=float(n.attrs.eps)
    )
    return (y, None, None)


def _bn_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return tuple(K.batchnorm_backward(a[0], a[1], env.ctx, tid(n)))


def _bn_affine(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    saved, gamma, beta = a
    return (K.batchnorm_affine(saved.xhat, gamma, beta, env.ctx, tid(n)),)


def _bn_running(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    rmean, rvar, saved = a
    momentum = FixedScalar.of(float(n.attrs.momentum))
    return tuple(
        K.batchnorm_update_running(
            rmean, rvar, saved.mean, saved.var_unbiased, momentum, env.ctx, tid(n)
        )
    )


def _layernorm(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    y, saved = K.layernorm_forward(
        a[0], a[1], a[2], float(at.eps), env.ctx, tid(n), int(at.groups), int(at.per)
    )
    return (y, saved)


def _layernorm_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return tuple(K.layernorm_backward(a[0], a[1], env.ctx, tid(n)))


def _batchnorm_module(c: Any, n: Any, m: Any) -> Value:
    """BatchNorm1d/2d/3d; without affine, its weight and bias constants 1 and 0 (never
    trained)."""
    if not m.track_running_stats:
        raise UnsupportedOpError(
            c.describe(
                n,
                "has track_running_stats=False, which normalizes with the batch's statistics "
                "in evaluation too; mexc's batch norm keeps running statistics for evaluation",
            )
        )
    assert m.running_mean is not None and m.running_var is not None
    name = str(n.target)
    size = int(m.num_features)
    ins = [
        c.arg(n.args[0]),
        c.param(f"{name}.weight", m.weight, "bn_weight")
        if m.affine
        else c.constant(f"{name}.weight", np.ones(size), "bn_weight"),
        c.param(f"{name}.bias", m.bias, "bn_bias")
        if m.affine
        else c.constant(f"{name}.bias", np.zeros(size), "bn_bias"),
        c.state(f"{name}.running_mean", m.running_mean, "running_mean", name),
        c.state(f"{name}.running_var", m.running_var, "running_var", name),
    ]
    if m.momentum is None:
        raise UnsupportedOpError(
            c.describe(n, "uses a cumulative running average (momentum=None); give a momentum")
        )
    return _emit_batchnorm(c, n, n.args[0], ins, float(m.eps), float(m.momentum))


def _emit_batchnorm(c: Any, n: Any, x: Any, ins: list[Value], eps: float, momentum: float) -> Value:
    """BATCHNORM of (N, C) or (N, C, H, W); BatchNorm1d's (N, C, L) as (N, C, 1, L) and
    BatchNorm3d's (N, C, T, H, W) as (N, C, T H, W): the same statistics per channel."""
    shape = tuple(c.shape(x))
    if len(shape) not in (2, 3, 4, 5):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"normalizes a {len(shape)}-D tensor; give it (N, C), (N, C, L), (N, C, H, W) "
                "or (N, C, T, H, W)",
            )
        )
    if shape[0] * math.prod(shape[2:]) < 2:
        raise InputError(
            c.describe(
                n,
                f"normalizes {list(shape)} with the batch's statistics, one value per channel "
                "(torch refuses it in training too: 'Expected more than 1 value per channel'); "
                "compile with a batch of at least 2 samples, or put the layer in eval mode",
            )
        )
    if len(shape) in (2, 4):
        return c.emit(Op.BATCHNORM, ins, n, eps=eps, momentum=momentum)
    seen = (
        (*shape[:2], 1, shape[2])
        if len(shape) == 3
        else (*shape[:2], shape[2] * shape[3], shape[4])
    )
    ins = [reshaped(c, ins[0], seen), *ins[1:]]
    y = c.emit_as(Op.BATCHNORM, ins, seen, eps=eps, momentum=momentum)
    return as_result(c, n, y)


def _standardized_weight(c: Any, n: Any, args: dict[str, Any], source: Any) -> Value:
    """Weight standardization (timm's StdConv2d and ScaledStdConv2d, BiT, NFNets):
    F.batch_norm(w.reshape(1, O, -1), None, None, weight=g, training=True) normalizes each
    output channel's row of the weight, computed again every step. As a GroupNorm (LAYERNORM
    with a group per row) of the weight copied once with a leading axis of 1 (EXPAND_PARAM,
    over_batch=False), whose gradient the parameter's update receives; `g` a parameter per row,
    a parameter times a number (ScaledStdConv2d's gain * scale: `gain_times`), or None."""
    shape = tuple(c.shape(n))
    declared = tuple(c.shape(source))
    rows = int(declared[0]) if declared else 0
    stats = [args.get(k) for k in ("running_mean", "running_var")]
    if (
        len(shape) != 3
        or shape[:2] != (1, rows)
        or any(s is not None for s in stats)
        or args.get("bias") is not None
        or args.get("training") is not True
    ):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"normalizes the parameter {source.target} with F.batch_norm in a form other "
                "than weight standardization's (w.reshape(1, out_channels, -1), no running "
                "statistics or bias, training=True); standardize the weight that way, or use "
                "the plain layer",
            )
        )
    per = int(shape[2])
    if per < 2:
        raise UnsupportedOpError(c.describe(n, "standardizes rows of one element"))
    weight = c.get_param(source, "weight")
    repeated = c.emit_as(Op.EXPAND_PARAM, [weight], (1, *declared), over_batch=False)
    ins = [reshaped(c, repeated, shape), *_row_gain(c, n, args.get("weight"), rows)]
    attrs = {"eps": float(args.get("eps", 1e-5)), "groups": rows, "per": per}
    return c.emit_as(Op.LAYERNORM, ins, shape, **attrs)


def _row_gain(c: Any, n: Any, g: Any, rows: int) -> list[Value]:
    """The LAYERNORM affine of a standardization (F.batch_norm's `weight`): ones where there
    is none, a parameter of `rows` elements (seen through a view), or such a parameter times a
    number (`gain_times`, computed each step)."""
    if g is None:
        return _constant_affine(c, n, rows)
    bias = c.constant(f"{n.name}.bias", np.zeros(rows), "ln_bias")
    held = c.env.get(g) if c.is_node(g) else None
    if isinstance(held, Value) and c.is_node(g) and called_name(g) == "gain_times":
        return [held, bias]
    node = _gain_parameter(c, g)
    if node is None:
        raise UnsupportedOpError(
            c.describe(
                n,
                "standardizes a weight with a gain that is not a parameter (or a parameter "
                "times a number); make the gain a module parameter",
            )
        )
    return [_gain_row(c, n, node, rows), bias]


def _gain_parameter(c: Any, g: Any) -> Any:
    """The get_attr node of the model parameter `g` reads, directly or through a view; None
    where it reads something else."""
    view = c.param_view(g)
    node = g if view is None else view.source
    return node if c.is_node(node) and c.is_param(node) and c.is_parameter(node) else None


def _gain_row(c: Any, n: Any, node: Any, rows: int) -> Value:
    """The gain parameter `node` held as a row of `rows` elements (timm's is (O, 1, 1, 1))."""
    tensor = c.fetch(node)
    if int(tensor.numel()) != rows:
        raise UnsupportedOpError(
            c.describe(n, f"standardizes a weight with a gain of {int(tensor.numel())} elements")
        )
    name = str(node.target)
    return c.param(name, tensor.reshape(-1), "ln_weight", arranged=as_rows(tensor), tie=tensor)


def gain_times(gain: Any, number: float) -> Any:
    """A standardization's gain times a number (ScaledStdConv2d's gain * gamma / sqrt(K)), in
    the norm's affine: what mexc.frontend_standardize puts in place of the product so that it
    is converted with the norm (one rounding of the weight, at the weight's exponent)."""
    return gain * number


def _gain_times(c: Any, n: Any) -> Value:
    """gain_times: the gain copied once with a leading axis of 1 (EXPAND_PARAM,
    over_batch=False), times the number (SCALE), seen as a row: a norm's affine computed from a
    parameter each step, whose gradient the SCALE and the copy pass back to it."""
    g, number = n.args
    node = _gain_parameter(c, g)
    if node is None:
        raise UnsupportedOpError(
            c.describe(n, "multiplies a gain that is not a parameter; make it one")
        )
    rows = int(c.fetch(node).numel())
    gain = _gain_row(c, n, node, rows)
    repeated = c.emit_as(Op.EXPAND_PARAM, [gain], (1, rows), over_batch=False)
    scaled = c.emit_as(Op.SCALE, [repeated], (1, rows), value=float(number))
    return reshaped(c, scaled, (rows,))


def batch_norm_arguments(n: Any) -> dict[str, Any]:
    """An F.batch_norm call's arguments by torch's names, positional or keyword."""
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum")
    return dict(zip((*names, "eps"), n.args)) | dict(n.kwargs)


def _batchnorm_function(c: Any, n: Any) -> Value:
    """F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps) on a
    module's buffers and parameters: timm's BatchNormAct2d, a BatchNorm2d subclass whose forward
    calls it. Its `training` argument is the traced (eval) one; like a BatchNorm2d module it
    normalizes with batch statistics in the step and running statistics in evaluation."""
    args = batch_norm_arguments(n)
    parts = [args.get(k) for k in ("running_mean", "running_var", "weight", "bias")]
    x = args["input"]
    view = c.param_view(x)
    if c.is_param(x) or view is not None:
        return _standardized_weight(c, n, args, x if view is None else view.source)
    if is_gathered(c, x):  # a parameter permuted or indexed first, or a constant
        raise UnsupportedOpError(
            c.describe(
                n,
                "normalizes a rearranged parameter (or a constant) with F.batch_norm; mexc "
                "standardizes a convolution's weight as w.reshape(1, out_channels, -1), each "
                "output channel's row: reshape the weight so, or use the plain layer",
            )
        )
    if not all(c.is_param(p) for p in parts):
        raise UnsupportedOpError(
            c.describe(
                n,
                "needs running statistics, weight and bias that are module buffers and "
                "parameters (affine=True, track_running_stats=True)",
            )
        )
    momentum = float(args.get("momentum", 0.1))
    if momentum <= 0.0:
        raise UnsupportedOpError(
            c.describe(n, "uses a cumulative running average (momentum=None); give a momentum")
        )
    mean, var, weight, bias = parts
    assert mean is not None  # is_param: a get_attr node
    owner = str(mean.target).rsplit(".", 1)[0]
    ins = [
        c.arg(args["input"]),
        c.get_param(weight, "bn_weight"),
        c.get_param(bias, "bn_bias"),
        c.get_state(mean, "running_mean", owner),
        c.get_state(var, "running_var", owner),
    ]
    return _emit_batchnorm(c, n, args["input"], ins, float(args.get("eps", 1e-5)), momentum)


def _module_affine(c: Any, n: Any, m: Any, size: int) -> list[Value]:
    """The weight and bias of a LayerNorm, GroupNorm or InstanceNorm module of `size`
    channels; one it does not have (affine off, bias=False) is a constant 1 or 0."""
    name = str(n.target)
    weight = getattr(m, "weight", None)
    bias = getattr(m, "bias", None)
    return [
        c.param(f"{name}.weight", weight, "ln_weight")
        if weight is not None
        else c.constant(f"{name}.weight", np.ones(size), "ln_weight"),
        c.param(f"{name}.bias", bias, "ln_bias")
        if bias is not None
        else c.constant(f"{name}.bias", np.zeros(size), "ln_bias"),
    ]


def _constant_affine(c: Any, n: Any, size: int) -> list[Value]:
    """A layer norm's weight and bias where it has none: constant ones and zeros."""
    return _function_affine(c, n, None, None, size)


def _function_affine(c: Any, n: Any, weight: Any, bias: Any, size: int) -> list[Value]:
    """The weight and bias F.layer_norm or F.group_norm reads: a module's parameters, or None
    (a constant 1 or 0, never trained: timm's LayerNorm2d without bias in MetaFormers)."""
    for what, v in (("weight", weight), ("bias", bias)):
        if v is not None and not c.is_param(v):
            raise UnsupportedOpError(
                c.describe(n, f"needs a {what} that is a module parameter (or None)")
            )
    return [
        c.get_param(weight, "ln_weight")
        if weight is not None
        else c.constant(f"{n.name}.weight", np.ones(size), "ln_weight"),
        c.get_param(bias, "ln_bias")
        if bias is not None
        else c.constant(f"{n.name}.bias", np.zeros(size), "ln_bias"),
    ]


def _layernorm_module(c: Any, n: Any, m: Any) -> Value:
    """nn.LayerNorm over its normalized_shape's trailing axes (one or several)."""
    sizes = tuple(int(d) for d in m.normalized_shape)
    if len(sizes) == 1:
        affine = _module_affine(c, n, m, sizes[0])
    else:  # held flattened, as the flattened axes it normalizes
        name, size = str(n.target), int(np.prod(sizes))
        affine = [
            c.param(f"{name}.{what}", t.reshape(-1), role, arranged=as_rows(t), tie=t)
            if t is not None
            else c.constant(f"{name}.{what}", np.full(size, fill), role)
            for what, t, role, fill in (
                ("weight", getattr(m, "weight", None), "ln_weight", 1.0),
                ("bias", getattr(m, "bias", None), "ln_bias", 0.0),
            )
        ]
    return _layer_norm_over(c, n, n.args[0], sizes, affine, float(m.eps))


def _layer_norm_over(
    c: Any, n: Any, x: Any, sizes: tuple[int, ...], affine: list[Value], eps: float
) -> Value:
    """LAYERNORM of x over its trailing axes `sizes` (several: flattened into one and back)."""
    shape = tuple(c.shape(x))
    k = len(sizes)
    if shape[-k:] != sizes or len(shape) <= k:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"normalizes {list(sizes)} of a tensor of shape {list(shape)}; mexc normalizes "
                "trailing axes other than the batch axis",
            )
        )
    if k == 1:
        return c.emit(Op.LAYERNORM, [c.arg(x), *affine], n, eps=eps)
    flat = (*shape[:-k], int(np.prod(sizes)))
    y = c.emit_as(Op.LAYERNORM, [reshaped(c, c.arg(x), flat), *affine], flat, eps=eps)
    return as_result(c, n, y)


def _layernorm_function(c: Any, n: Any) -> Value:
    """F.layer_norm(x, normalized_shape, weight, bias, eps) with a module's weight and bias
    (ConvNeXt's LayerNorm2d on channels-last activations), over one or several trailing
    axes."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    shape = static_value(args["normalized_shape"])
    sizes = tuple(int(d) for d in (shape if isinstance(shape, (list, tuple)) else (shape,)))
    eps = float(args.get("eps", 1e-5))
    if len(sizes) == 1:
        affine = _function_affine(c, n, args.get("weight"), args.get("bias"), sizes[0])
        return _layer_norm_over(c, n, args["input"], sizes, affine, eps)
    size = int(np.prod(sizes))
    affine = []
    for what, v, role, fill in (
        ("weight", args.get("weight"), "ln_weight", 1.0),
        ("bias", args.get("bias"), "ln_bias", 0.0),
    ):
        if v is None:
            affine.append(c.constant(f"{n.name}.{what}", np.full(size, fill), role))
        elif c.is_param(v):
            t = c.fetch(v)
            affine.append(c.param(str(v.target), t.reshape(-1), role, arranged=as_rows(t), tie=t))
        else:
            raise UnsupportedOpError(
                c.describe(n, f"needs a {what} that is a module parameter (or None)")
            )
    return _layer_norm_over(c, n, args["input"], sizes, affine, eps)


def over_rms(c: Any, n: Any, v: Value, shape: tuple[int, ...], eps: float) -> Value:
    """v / sqrt(mean(v^2) + eps) along the last axis, as a LayerNorm: z = [v, -v] has mean 0
    exactly, so LayerNorm(z) (no affine: constant ones and zeros) = z / sqrt(mean(v^2) + eps),
    whose first half it is. Its gradient is the LayerNorm's through the concatenation (the
    functions agree for every v)."""
    d, last = shape[-1], len(shape) - 1
    wide = (*shape[:-1], 2 * d)
    z = concatenated(c, [v, scaled(c, v, shape, -1.0)], wide, last)
    y = layer_normalized(c, n, z, wide, eps)
    return sliced(c, y, wide, last, 0, d)


def layer_normalized(c: Any, n: Any, v: Value, shape: tuple[int, ...], eps: float) -> Value:
    """v's layer norm over its last axis without affine (constant ones and zeros)."""
    return c.emit_as(Op.LAYERNORM, [v, *_constant_affine(c, n, shape[-1])], shape, eps=float(eps))


def _rms_norm(c: Any, n: Any, x: Any, size: Any, weight: Value | None, eps: Any) -> Value:
    """RMSNorm over the last axis (nn.RMSNorm, F.rms_norm, timm's RmsNorm): x / rms(x)
    (_over_rms; eps None: float32's machine epsilon, torch's default), times the weight."""
    shape = tuple(c.shape(x))
    sizes = tuple(size) if isinstance(size, (list, tuple)) else (size,)
    if tuple(int(s) for s in sizes) != shape[-1:]:
        raise UnsupportedOpError(c.describe(n, "normalizes more than the last axis"))
    eps = 2.0**-23 if eps is None else float(eps)
    y = over_rms(c, n, c.arg(x), shape, eps)
    return y if weight is None else multiplied(c, y, weight, shape)


def _rms_norm_module(c: Any, n: Any, m: Any) -> Value:
    w = getattr(m, "weight", None)
    weight = c.param(f"{n.target}.weight", w, "scale") if w is not None else None
    return _rms_norm(c, n, n.args[0], m.normalized_shape, weight, m.eps)


def _rms_norm_function(c: Any, n: Any) -> Value:
    args = dict(zip(("input", "normalized_shape", "weight", "eps"), n.args)) | dict(n.kwargs)
    w = args.get("weight")
    weight = c.get_param(w, "scale") if w is not None else None
    shape = static_value(args["normalized_shape"])
    return _rms_norm(c, n, args["input"], shape, weight, static_value(args.get("eps")))


def _normalize(c: Any, n: Any) -> Value:
    """F.normalize(x, p=2, dim): x / max(|x|, eps) along a non-batch axis (cosine attention,
    cosine classifiers): _unit."""
    args = dict(zip(("input", "p", "dim", "eps"), n.args)) | dict(n.kwargs)
    x = args["input"]
    shape = tuple(c.shape(x))
    dims = _norm_dims(c, n, static_value(args.get("p", 2.0)), args.get("dim", 1), x)
    eps = float(static_value(args.get("eps", 1e-12)))
    check_floor(c, n, eps)
    return _unit(c, n, c.arg(x), shape, dims, eps)


def _norm_dims(c: Any, n: Any, p: Any, dim: Any, x: Any) -> tuple[int, ...]:
    """The axes of a 2-norm of x (p 2, "fro" or None), sorted; an error naming n for another
    p, no axes or the batch axis (wherever x holds it: after a permute too)."""
    shape = tuple(c.shape(x))
    dims = static_value(dim)
    axes = dims if isinstance(dims, (list, tuple)) else [dims]
    if p not in (2, 2.0, "fro", None) or dims is None or not axes:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"takes a norm with p={p!r} or over all axes; mexc takes p=2 over named "
                "non-batch axes",
            )  # fmt: skip
        )
    out = tuple(sorted({static_int(d) % len(shape) for d in axes}))
    if c.first_or_batch_axis(c.arg(x)) in out:
        raise UnsupportedOpError(c.describe(n, "takes a norm along the batch axis"))
    return out


def along(
    c: Any,
    v: Value,
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    f: Callable[[Value, tuple[int, ...]], Value],
) -> Value:
    """f applied to v with the axes `dims` moved last and flattened into one (f sees a value
    of that flat shape and returns one), and the axes moved back."""
    rank = len(shape)
    perm = (*(a for a in range(rank) if a not in dims), *dims)
    moved = tuple(shape[a] for a in perm)
    d = int(np.prod([shape[a] for a in dims]))
    flat = (*moved[: rank - len(dims)], d)
    if perm != tuple(range(rank)):
        v = transposed(c, v, shape, perm)
    if flat != moved:
        v = reshaped(c, v, flat)
    y = f(v, flat)
    if flat != moved:
        y = reshaped(c, y, moved)
    if perm == tuple(range(rank)):
        return y
    return transposed(c, y, moved, tuple(perm.index(a) for a in range(rank)))


def _unit(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], dims: tuple[int, ...], eps: float
) -> Value:
    """v / max(|v|, eps), |v| the 2-norm over `dims`: along those axes, v / rms(v) (over_rms)
    = sqrt(D) v / |v|, scaled by 1 / sqrt(D). eps' = eps^2 / D puts torch's floor on |v|
    inside the root."""
    d = int(np.prod([shape[a] for a in dims]))

    def unit(u: Value, flat: tuple[int, ...]) -> Value:
        y = over_rms(c, n, u, flat, max(eps * eps / d, 1e-30))
        return scaled(c, y, flat, 1.0 / math.sqrt(d))

    return along(c, v, shape, dims, unit)


_NORM_ARGS = {  # each function's argument names, in order
    "norm": ("input", "p", "dim", "keepdim"),
    "linalg_vector_norm": ("input", "ord", "dim", "keepdim"),  # torch.linalg.vector_norm
    "linalg_norm": ("input", "ord", "dim", "keepdim"),  # torch.linalg.norm
}


def _norm_order(c: Any, n: Any, name: str, args: dict[str, Any]) -> Any:
    """The p of a norm call. torch.linalg.norm over two axes is a matrix norm: its ord None
    or "fro" is the 2-norm of the entries, any other (2 is the spectral norm) is refused."""
    default = None if name == "linalg_norm" else 2
    p = static_value(args.get("p", args.get("ord", default)))
    dims = static_value(args.get("dim"))
    matrix = name == "linalg_norm" and isinstance(dims, (list, tuple)) and len(dims) == 2
    if matrix and p not in (None, "fro"):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"takes the matrix norm ord={p!r} (torch.linalg.norm over two axes); mexc "
                "takes the Frobenius norm, ord=None or 'fro'",
            )
        )
    return p


def _norm_call(c: Any, n: Any) -> tuple[Any, tuple[int, ...]] | None:
    """(x, axes) of a 2-norm call over named axes with keepdim (x.norm(dim=-1, keepdim=True),
    torch.linalg.vector_norm(x, 2, (1, 2), True)), else None."""
    if not c.is_node(n) or n.op not in ("call_method", "call_function"):
        return None
    name = called_name(n)
    if name not in _NORM_ARGS:
        return None
    args = dict(zip(_NORM_ARGS[name], n.args)) | dict(n.kwargs)
    if not static_value(args.get("keepdim", False)):
        return None
    p = _norm_order(c, n, name, args)
    return args["input"], _norm_dims(c, n, p, args.get("dim"), args["input"])


def _vector_norm(c: Any, n: Any) -> Value:
    """x.norm(p=2, dim, keepdim), torch.norm, torch.linalg.vector_norm over non-batch axes:
    |x| = sum(x * x / |x|) over the axes (_unit, a `mul`, their mean times their count),
    exact as a function; its gradient x / |x| is the product's."""
    name = called_name(n)
    args = dict(zip(_NORM_ARGS[name], n.args)) | dict(n.kwargs)
    dtype = args.get("dtype")
    if dtype is not None and not getattr(dtype, "is_floating_point", False):
        raise UnsupportedOpError(c.describe(n, f"takes a norm in {dtype}; give a float dtype"))
    x = args["input"]
    shape = tuple(c.shape(x))
    dims = _norm_dims(c, n, _norm_order(c, n, name, args), args.get("dim"), x)
    v = c.arg(x)
    squares = multiplied(c, v, _unit(c, n, v, shape, dims, 0.0), shape)
    count = int(np.prod([shape[a] for a in dims]))
    mean = mean_over(c, squares, shape, list(dims), tuple(c.shape(n)))
    norm = scaled(c, mean, c.shape(n), count)
    c.norm_of[norm] = (v, dims)  # for x / x.norm(...) (_over_its_norm)
    return norm


def _over_its_norm(c: Any, n: Any, a: Any, b: Any) -> Value | None:
    """a / b where b is a's 2-norm over axes, with keepdim (x / x.norm(dim=-1, keepdim=True),
    also floored: .clamp(min=eps), .clamp_min(eps), + eps): F.normalize's _unit; None for
    another divisor."""
    eps, chain = 0.0, [b]
    floor = floor_of(b) if c.is_node(b) else None
    while floor is not None:
        b, eps = floor[0], max(eps, floor[1])
        chain.append(b)
        floor = floor_of(b) if c.is_node(b) else None
    call = _norm_call(c, b)
    if call is None or call[0] is not a:
        return None
    held = c.norm_of.get(c.env.get(b))
    if held is None or held[0] is not c.arg(a) or any(m in c.rebound for m in chain):
        return None  # the norm or its floor changed in place, or x since its norm was taken
    check_floor(c, n, eps)
    return _unit(c, n, c.arg(a), tuple(c.shape(a)), call[1], eps)


# the largest eps of a floor on |x| (F.normalize's, a norm's clamp or + eps) mexc takes: its
# floor is sqrt(|x|^2 + eps^2) (_unit), which differs from max(|x|, eps) and |x| + eps by less
# than eps
MAX_FLOOR = 1e-4


def check_floor(
    c: Any,
    n: Any,
    eps: float,
    what: str = "floors a 2-norm",
    how: str = "computes the floor as sqrt(|x|^2 + eps^2), which is torch's max(|x|, eps) or "
    "|x| + eps",
) -> None:
    """Refuse, naming n, a floor eps above MAX_FLOOR that mexc computes another way (`how`)."""
    if eps > MAX_FLOOR:
        raise UnsupportedOpError(
            c.describe(n, f"{what} at {eps}; mexc {how} only for eps <= {MAX_FLOOR}")
        )


FLOORS = ("clamp", "clamp_min", "clip")
ADDS = ("add", "iadd", "__add__", "__radd__")


def floor_of(b: Any) -> tuple[Any, float] | None:
    """(y, eps) where b is y.clamp(min=eps), y.clamp_min(eps), torch.clamp(y, min=eps),
    y + eps or eps + y for a finite number eps >= 0; else None (a norm's floor here, the eps
    of a written-out norm's mean square in norm_written_out)."""
    name = called_name(b)
    args = list(b.args)
    if name in FLOORS and args:
        low = static_value(b.kwargs.get("min", args[1] if len(args) > 1 else None))
        if "max" not in b.kwargs and len(args) <= 2 and finite_number(low):
            return (args[0], float(low)) if low >= 0 else None
    if name in ADDS and len(args) == 2:
        for y, e in ((args[0], static_value(args[1])), (args[1], static_value(args[0]))):
            if finite_number(e) and e >= 0 and is_traced_tensor(y):
                return y, float(e)
    return None


def _groupnorm(c: Any, n: Any, x: Any, groups: Any, affine: list[Value], eps: Any) -> Value:
    """GroupNorm as LayerNorm over rows (sample, group) of C/G x P elements, with the affine
    per channel (`groups`, `per` = P: kernels.layernorm_forward)."""
    shape = tuple(c.shape(x))
    per = int(np.prod(shape[2:]))  # 1 for (N, C)
    if per * int(shape[1]) // int(groups) < 2:
        raise UnsupportedOpError(c.describe(n, "normalizes groups of one element"))
    if per == 1 and len(shape) > 2:
        # (N, C, 1, 1) as (N, C): groups = per = 1 would otherwise read as a LayerNorm over
        # the last axis, of one element
        flat = reshaped(c, c.arg(x), shape[:2])
        attrs = {"eps": float(eps), "groups": int(groups), "per": 1}
        y = c.emit_as(Op.LAYERNORM, [flat, *affine], shape[:2], **attrs)
        return as_result(c, n, y)
    return c.emit(Op.LAYERNORM, [c.arg(x), *affine], n, eps=float(eps), groups=int(groups), per=per)


def _groupnorm_module(c: Any, n: Any, m: Any) -> Value:
    affine = _module_affine(c, n, m, int(m.num_channels))
    return _groupnorm(c, n, n.args[0], m.num_groups, affine, m.eps)


def _instancenorm_module(c: Any, n: Any, m: Any) -> Value:
    """InstanceNorm1d/2d/3d with affine weight and bias and no running statistics: GroupNorm
    with a group per channel (the statistics of each sample's channel, in training and in
    evaluation alike)."""
    if m.track_running_stats:
        raise UnsupportedOpError(
            c.describe(
                n,
                "needs InstanceNorm with track_running_stats=False (mexc lowers it as "
                "GroupNorm with a group per channel, on each sample's own statistics)",
            )
        )
    affine = _module_affine(c, n, m, int(m.num_features))
    return _groupnorm(c, n, n.args[0], m.num_features, affine, m.eps)


def _groupnorm_function(c: Any, n: Any) -> Value:
    """F.group_norm(x, num_groups, weight, bias, eps) with a module's weight and bias (timm's
    GroupNorm and GroupNorm1)."""
    names = ("input", "num_groups", "weight", "bias", "eps")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    affine = _function_affine(c, n, args.get("weight"), args.get("bias"), c.shape(n)[1])
    groups = static_int(args["num_groups"])
    return _groupnorm(c, n, args["input"], groups, affine, args.get("eps", 1e-5))


define(
    OpDef(
        Op.BATCHNORM,
        {"eps": 1e-5, "momentum": 0.1, "rid": -1},
        types=_batchnorm_types,
        vjp=_batchnorm_vjp,
        reference=_batchnorm,
        running_update=_running_update,
        frontend=(
            Pattern(
                "module",
                # SyncBatchNorm: the whole batch's statistics, which mexc's batch norm takes
                # in a data-parallel job too (docs/distributed.md)
                (
                    "torch.nn.BatchNorm2d",
                    "torch.nn.BatchNorm1d",
                    "torch.nn.BatchNorm3d",
                    "torch.nn.SyncBatchNorm",
                ),
                _batchnorm_module,
            ),
            Pattern("function", ("torch.nn.functional.batch_norm",), _batchnorm_function),
        ),
        lower={
            "tir": "step_plan:PlanRules.batchnorm",
            "tir_eval": "step_plan:PlanRules.batchnorm_eval",
            "c": "emit:_batchnorm",
        },
        # y over x where x dies here (a convolution's output): the C kernel reads each element
        # of x before it writes that element of xhat or y (docs/mcu.md)
        in_place=True,
        doc="batch norm: batch statistics in training, running statistics in evaluation",
        data_parallel=True,
        batch_whole=(2,),
    ),
    OpDef(
        Op.BATCHNORM_GRAD,
        {"rid": -1},
        reference=_bn_grad,
        lower={"tir": "step_plan:PlanRules.batchnorm_grad", "c": "emit:_bn_grad"},
        # dx over dy where dy dies here: the C kernel's last pass reads each element of dy
        # before it writes that element of dx, its earlier passes write nothing of dx
        in_place=True,
        doc="dx, dgamma, dbeta of batch norm",
        data_parallel=True,
        batch_whole=(1, 2),
    ),
    OpDef(
        Op.BATCHNORM_AFFINE,
        {"rid": -1},
        reference=_bn_affine,
        lower={"tir": "step_plan:PlanRules.batchnorm_affine", "c": "emit:_bn_affine"},
        doc="batch norm's training output again from its saved xhat, gamma and beta, with the "
        "batch norm's rid: the same bits (the rematerialize pass)",
        data_parallel=True,
    ),
    OpDef(
        Op.BN_RUNNING_UPDATE,
        {"momentum": 0.1, "rid": -1},
        reference=_bn_running,
        lower={"tir": "step_plan:PlanRules.bn_running", "c": "emit:_bn_running"},
        overwrites=(0, 1),
        updates_state=True,
        doc="running mean and variance <- momentum blend with the batch statistics",
    ),
    OpDef(
        Op.LAYERNORM,
        {"eps": 1e-5, "groups": 1, "per": 1, "rid": -1},
        types=_layernorm_types,
        keeps_axes=_row_norm,
        vjp=_layernorm_vjp,
        reference=_layernorm,
        frontend=(
            Pattern("module", ("torch.nn.LayerNorm",), _layernorm_module),
            Pattern("function", ("torch.nn.functional.layer_norm",), _layernorm_function),
            Pattern("function", ("torch.nn.functional.normalize",), _normalize),
            Pattern("method", ("norm",), _vector_norm),
            Pattern(
                "function",
                ("torch.norm", "torch.linalg.vector_norm", "torch.linalg.norm"),
                _vector_norm,
            ),
            Pattern("function", ("torch.nn.functional.rms_norm",), _rms_norm_function),
            Pattern("module", ("torch.nn.RMSNorm", "timm.layers.norm.RmsNorm"), _rms_norm_module),
            Pattern("module", ("torch.nn.GroupNorm",), _groupnorm_module),
            Pattern(
                "module",
                ("torch.nn.InstanceNorm1d", "torch.nn.InstanceNorm2d", "torch.nn.InstanceNorm3d"),
                _instancenorm_module,
            ),
            Pattern("function", ("torch.nn.functional.group_norm",), _groupnorm_function),
            Pattern("function", ("mexc.ops.norm.gain_times",), _gain_times),
        ),
        lower={"tir": "step_plan:PlanRules.layernorm", "c": "emit:_layernorm"},
        doc="layer norm over the last axis; group norm (`groups`, `per` elements per channel): "
        "rows (sample, group), the affine per channel",
        data_parallel=True,
    ),
    OpDef(
        Op.LAYERNORM_GRAD,
        {"groups": 1, "per": 1, "rid": -1},
        reference=_layernorm_grad,
        lower={"tir": "step_plan:PlanRules.layernorm_grad", "c": "emit:_layernorm_grad"},
        doc="dx, dgamma, dbeta of layer norm",
        data_parallel=True,
        batch_partial=(1, 2),
    ),
)

ACTIVATION_DIVISORS.append(_over_its_norm)
