"""Tensor ops: sums, reshapes, dropout, scaling, transposes, slices, broadcast parameters and
token means, and their gradients."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.kernels.elementwise import dropout_group
from mexc.mx import MX, Acc
from mexc.ops.common import (
    Grads,
    ParamView,
    called_name,
    elementwise_types,
    finite_number,
    keeps_batch_dim,
    no_saved,
    off_dim,
    param_grad_share,
    pointwise_vjp,
    pool_call_arguments,
    reshaped_batch_axis,
    scalar,
    sliced_batch_axis,
    static_int,
    static_value,
    tid,
    tir_rule,
    transposed_batch_axis,
    with_index_types,
)
from mexc.ops.gather import (
    Concatenated,
    Const,
    Gathered,
    as_gathered,
    const_gathered,
    gathered_value,
    is_gathered,
    static_tensor,
)
from mexc.ops.registry import OpDef, Pattern, define
from mexc.types import acc, mx

# ----------------------------------------------------------------------------- VJPs


def _add_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    return [dys[0] if w.needs[v] else None for v in n.inputs]


def _reshape_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x = n.inputs[0]
    if not w.needs[x]:
        return [None]
    shape = w.type(x).shape
    return [w.emit(Op.RESHAPE, [dy], mx(*shape), n.loc, shape=shape).out]


def _transpose_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    perm = tuple(n.attrs.perm)
    inverse = tuple(perm.index(i) for i in range(len(perm)))
    return [w.emit(Op.TRANSPOSE, [dy], mx(*w.type(n.inputs[0]).shape), n.loc, perm=inverse).out]


def _concat_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """dx_i = dy[start_i:stop_i] along the concatenated axis (exponent e_dy, no rounding)."""
    dy = dys[0]
    assert dy is not None
    dim, start, out = int(n.attrs.dim), 0, []
    for x in n.inputs:
        shape = w.type(x).shape
        stop = start + shape[dim]
        out.append(
            w.emit(Op.SLICE, [dy], mx(*shape), n.loc, dim=dim, start=start, stop=stop).out
            if w.needs[x]
            else None
        )
        start = stop
    return out


def _mul_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """dx = dy * g (the forward op on dy); dg = the sum of dy * x over g's broadcast axes: a
    parameter's as an int32 accumulator for the update, an activation's compacted."""
    dy = dys[0]
    assert dy is not None
    x, g = n.inputs
    view = tuple(n.attrs.view)
    dx = None
    if w.needs[x]:
        dx = w.emit(Op.MUL, [dy, g], mx(*w.type(x).shape), n.loc, view=view).out
    shape = w.type(g).shape
    if w.g.node(g.node).op is Op.PARAM:
        dp = w.emit(Op.MUL_GRAD, [dy, x], acc(*shape), n.loc, param=True, view=view)
        w.set_param_grad(g, dp.out, n)
        return [dx, None]
    if not w.needs[g]:
        return [dx, None]
    return [dx, w.emit(Op.MUL_GRAD, [dy, x], mx(*shape), n.loc, param=False).out]


def _div_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """da = dy / b; db = -(dy q) / b with q = a / b, the forward's result (MUL, DIV, SCALE)."""
    dy = dys[0]
    assert dy is not None
    a, b = n.inputs
    shape = mx(*w.type(a).shape)
    da = w.emit(Op.DIV, [dy, b], shape, n.loc).out if w.needs[a] else None
    if not w.needs[b]:
        return [da, None]
    p = w.emit(Op.MUL, [dy, n.out], shape, n.loc).out
    r = w.emit(Op.DIV, [p, b], shape, n.loc).out
    return [da, w.emit(Op.SCALE, [r], shape, n.loc, value=-1.0).out]


def _expand_param_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """The parameter's gradient: dy summed over the batch (ADD_PARAM_GRAD)."""
    dy = dys[0]
    assert dy is not None
    p = n.inputs[0]
    dp = w.emit(Op.ADD_PARAM_GRAD, [dy], acc(*w.type(p).shape), n.loc)
    w.set_param_grad(p, dp.out, n)
    return [None]


def _add_param_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, p = n.inputs
    view = tuple(n.attrs.view)
    dp = w.emit(Op.ADD_PARAM_GRAD, [dy], acc(*w.type(p).shape), n.loc, view=view)
    w.set_param_grad(p, dp.out, n)
    return [dy if w.needs[x] else None, None]


# ----------------------------------------------------------------------------- reference


def _add(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.add_forward(a[0], a[1], env.ctx, tid(n)),)


def _concat(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.concat_forward(list(a), int(n.attrs.dim), env.ctx, tid(n)),)


def _mul_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    g: MX = a[1]
    if n.attrs.view:
        g = MX(g.m.reshape(n.attrs.view), g.e)
    return (K.mul_forward(a[0], g, env.ctx, tid(n)),)


def _div_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.div_forward(a[0], a[1], env.ctx, tid(n)),)


def _mul_grad_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    g_shape = tuple(n.attrs.view or n.type.shape)
    dg = K.mul_backward_factor(a[0], a[1], g_shape, env.ctx, tid(n), bool(n.attrs.param))
    if isinstance(dg, MX):
        return (MX(dg.m.reshape(n.type.shape), dg.e),)
    return (type(dg)(dg.a.reshape(n.type.shape), dg.e),)


def _grad_sum(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.grad_sum(list(a), env.ctx, tid(n)),)


def _reshape(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    x: MX = a[0]
    return (MX(x.m.reshape(n.attrs.shape), x.e),)


def _dropout(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    if not env.train:
        return (a[0], None)
    mode = str(n.attrs.mode)
    per = dropout_group(tuple(n.type.shape), mode)
    p = float(n.attrs.p)
    return tuple(K.dropout_forward(a[0], p, env.ctx, tid(n), per, whole=mode == "batch"))


def _dropout_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.dropout_backward(a[0], a[1], float(n.attrs.p), env.ctx, tid(n)),)


def _scale(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.scale_forward(a[0], scalar(n), env.ctx, tid(n)),)


def _scale_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.scale_backward(a[0], scalar(n), env.ctx, tid(n)),)


def _transpose(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    x: MX = a[0]
    return (MX(np.ascontiguousarray(x.m.transpose(n.attrs.perm)), x.e),)


def _slice(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    x: MX = a[0]
    index = [slice(None)] * x.m.ndim
    index[n.attrs.dim] = slice(n.attrs.start, n.attrs.stop)
    return (MX(np.ascontiguousarray(x.m[tuple(index)]), x.e),)


def _slice_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    dy: MX = a[0]
    out = np.zeros(n.type.shape, np.int8)
    index = [slice(None)] * out.ndim
    index[n.attrs.dim] = slice(n.attrs.start, n.attrs.stop)
    out[tuple(index)] = dy.m
    return (MX(out, dy.e),)


def _repeated_over_batch(n: Node) -> bool:
    """EXPAND_PARAM's results are batch-major unless it makes one copy (over_batch=False: a
    standardized weight's, ops.norm), which every data-parallel worker computes whole."""
    return bool(n.attrs.over_batch)


def _expand_param(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    p: MX = a[0]
    return (MX(np.ascontiguousarray(np.broadcast_to(p.m, n.type.shape)), p.e),)


def _add_param(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.add_broadcast_forward(a[0], a[1], env.ctx, tid(n), tuple(n.attrs.view)),)


def _add_param_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    dp = K.add_broadcast_param_grad(a[0], tuple(n.attrs.view))
    return (Acc(dp.a.reshape(n.type.shape), dp.e),)


def _mean_tokens(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.mean_tokens_forward(a[0], env.ctx, tid(n)),)


def _mean_tokens_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.mean_tokens_backward(a[0], n.type.shape[1], env.ctx, tid(n)),)


# ----------------------------------------------------------------------------- frontend


def _add_tensors(c: Any, n: Any) -> Value:
    a, b = n.args[0], n.args[1]
    for zero, other in ((a, b), (b, a)):
        # an accumulator started at 0 (`total = 0; total = total + t`, FocalNet, MobileOne)
        if not c.is_node(zero) and zero == 0 and c.is_node(other):
            if tuple(c.shape(other)) != tuple(c.shape(n)):
                break  # 0 broadcast wider than the tensor: refused below
            return c.arg(other)
    if not c.is_node(a) or not c.is_node(b):
        x, k = (a, b) if c.is_node(a) else (b, a)
        return number_added(c, n, c.arg(x), tuple(c.shape(x)), k)
    if n.kwargs.get("alpha", 1) != 1:
        raise UnsupportedOpError(c.describe(n, "uses alpha != 1"))
    out = tuple(c.shape(n))
    sides = [tuple(c.shape(a)), tuple(c.shape(b))]
    if sides[0] != sides[1]:
        if not all(broadcastable(sh, out) for sh in sides):
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"adds {list(sides[0])} and {list(sides[1])}; mexc broadcasts "
                    "axes of size 1 other than the batch axis",
                )  # fmt: skip
            )
        ins = [broadcast(c, n, c.arg(t), sh, out) for t, sh in zip((a, b), sides)]
        return c.emit(Op.ADD, ins, n)
    return c.emit(Op.ADD, [c.arg(a), c.arg(b)], n)


def _add_any(c: Any, n: Any) -> Value:
    """tensor + tensor, or an activation + a parameter that broadcasts over it: [1, ...] of
    its per-sample shape (a positional embedding), or along one run of axes ([C, 1, 1] or
    [1, C, 1, 1] per channel, [C] channels-last, [1] for all: a learnable bias or shift such
    as MetaFormer's StarReLU and HGNetV2's affine blocks), possibly seen through a reshape."""
    a, b = n.args[0], n.args[1]
    if n.kwargs.get("alpha", 1) != 1:
        raise UnsupportedOpError(c.describe(n, "uses alpha != 1"))
    if is_boolean(n):
        raise UnsupportedOpError(
            c.describe(n, "adds two masks (torch's logical or of booleans); write m1 | m2")
        )
    for zero, x in ((a, b), (b, a)):  # x + zeros the forward made (DETR's zeros_like target)
        values = static_tensor(c, zero) if c.is_node(zero) and c.is_node(x) else None
        if values is not None and not values.any() and tuple(c.shape(x)) == tuple(c.shape(n)):
            return c.arg(x)
    param = functools.partial(_param_like, c)
    if is_gathered(c, a) or is_gathered(c, b) or (param(a) and param(b)):
        return _with_gathered(c, n, Op.ADD)
    if param(b) and not param(a):
        a, b = b, a
    if not (param(a) and c.is_node(b)):
        return _add_tensors(c, n)
    if _seen_shape(c, n, a, tuple(c.shape(b))) is None:  # not along one run of axes
        return _with_gathered(c, n, Op.ADD)
    return _add_parameter(c, n, a, c.arg(b), tuple(c.shape(b)))


def _param_like(c: Any, v: Any) -> bool:
    """v is a parameter read directly or seen through a reshape (a ParamView)."""
    return c.is_param(v) or c.param_view(v) is not None


def _with_gathered(c: Any, n: Any, op: Op) -> Value:
    """n = a + b or a * b (`op`), where a parameter or buffer is read through indexing or
    broadcast over an activation in a way add_param and mul do not take (a relative-position
    bias, an attention mask over windows): each such operand a gather_param of n's shape, an
    activation broadcast to it."""
    out = tuple(c.shape(n))
    ins = []
    for t in n.args[:2]:
        held = folded_value(c, n, t, out)
        if held is not None:
            ins.append(held)
        elif c.is_node(t) and broadcastable(tuple(c.shape(t)), out):
            ins.append(broadcast(c, n, c.arg(t), tuple(c.shape(t)), out))
        else:
            raise UnsupportedOpError(
                c.describe(n, f"combines a parameter with {t!r}, which is not an activation")
            )
    return c.emit(op, ins, n)


def folded_value(c: Any, n: Any, a: Any, out: tuple[int, ...]) -> Value | None:
    """Operand `a` of n, a parameter or constant the frontend folded (read through indexing,
    or several concatenated), broadcast to `out` (the activation's shape it meets); None where
    `a` is none of those."""
    held = c.env.get(a) if c.is_node(a) else None
    if not isinstance(held, Concatenated):
        g = as_gathered(c, a)
        return gathered_value(c, n, g, out) if g is not None else None
    axis = len(out) + held.dim
    sizes = [int(p.index.shape[held.dim]) for p in held.parts]
    if axis <= 0 or sum(sizes) != out[axis]:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"combines an activation of shape {list(out)} with parameters concatenated "
                f"along axis {held.dim}, which does not meet its non-batch axis {axis}",
            )
        )
    pieces = [
        gathered_value(c, n, p, (*out[:axis], k, *out[axis + 1 :]))
        for p, k in zip(held.parts, sizes)
    ]
    return concatenated(c, pieces, out, axis)


def folded_constant(
    c: Any, n: Any, v: Any, out: tuple[int, ...], f: Callable[[np.ndarray], np.ndarray]
) -> Value | None:
    """f of operand v of n, where v is a constant tensor (a float buffer, or a tensor the
    forward computes from neither the input nor parameters, read through indexing), computed
    on the host and broadcast to `out` (a gather_param of a constant); None where v is none
    (a parameter, an activation, a number). Non-finite results are refused by node."""
    g = as_gathered(c, v)
    if g is None:  # an integer or boolean constant (a buffer of counts, a comparison's mask)
        values = static_tensor(c, v)
        g = const_gathered(v, values.astype(np.float64)) if values is not None else None
    if g is None or g.value is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        values = f(np.asarray(g.value, np.float64))
    if not np.isfinite(values).all():
        raise UnsupportedOpError(
            c.describe(n, "divides by a constant tensor holding zeros (or computes infinities)")
        )
    return gathered_value(c, n, Gathered(g.source, g.index, values.astype(np.float32)), out)


def _is_activation(c: Any, v: Any) -> bool:
    return c.is_node(v) and isinstance(c.env.get(v), Value)


def plus_folded_bias(c: Any, n: Any, y: Value, bias: Any, out: tuple[int, ...]) -> Value:
    """y + bias, where a layer's bias is a folded parameter expression (F.linear with BEiT's
    torch.cat((q_bias, k_bias, v_bias))): the layer runs without it and the sum follows."""
    b = folded_value(c, n, bias, out)
    if b is None:
        raise UnsupportedOpError(
            c.describe(n, "takes a bias that is neither a parameter nor made from parameters")
        )
    return added(c, y, b, out)


def _seen_shape(c: Any, n: Any, p: Any, x_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape parameter p is seen as over an activation of x_shape, right-aligned, where it
    varies along one run of non-batch axes; else None."""
    view = c.param_view(p)
    shape = tuple(view.shape) if view is not None else tuple(c.shape(p))
    seen = (1,) * (len(x_shape) - len(shape)) + shape
    if (
        len(seen) != len(x_shape)
        or seen[0] != 1
        or tuple(c.shape(n)) != x_shape
        or K.factor_view(x_shape, seen) is None
    ):
        return None
    return seen


def _param_seen(c: Any, n: Any, p: Any, x_shape: tuple[int, ...], what: str) -> tuple:
    """(the shape parameter p is seen as over an activation of x_shape, right-aligned, and
    its ParamView or None), refused unless it varies along one run of non-batch axes."""
    view = c.param_view(p)
    shape = tuple(view.shape) if view is not None else tuple(c.shape(p))
    seen = _seen_shape(c, n, p, x_shape)
    if seen is None:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"{what} a parameter seen as {list(shape)} and {list(x_shape)}; mexc takes "
                "parameters that vary along one run of the activation's non-batch axes "
                "([1, ...] of its per-sample shape, [C, 1, 1], [C], [1])",
            )
        )
    return seen, view


def _add_parameter(c: Any, n: Any, p: Any, xv: Value, x_shape: tuple[int, ...]) -> Value:
    """xv + the parameter p (a get_attr or a ParamView), n's result."""
    seen, view = _param_seen(c, n, p, x_shape, "adds")
    if view is None and seen == tuple(c.shape(p)) and seen[1:] == x_shape[1:]:
        return c.emit(Op.ADD_PARAM, [xv, c.get_param(p, "embedding")], n)  # a position
    role = "embedding" if seen[1:] == x_shape[1:] else "bias"
    source = view.source if view is not None else p
    return c.emit(Op.ADD_PARAM, [xv, c.get_param(source, role)], n, view=seen)


def _addcmul(c: Any, n: Any) -> Value:
    """torch.addcmul(input, t1, t2, value): input + value t1 t2, with t1 or t2 a parameter
    broadcast over the other (ResMLP's affine layers: beta + alpha x) or both activations of
    one shape, and input a parameter (add_param) or an activation of the result's shape."""
    args = dict(zip(("input", "tensor1", "tensor2"), n.args)) | dict(n.kwargs)
    base, t1, t2 = args["input"], args["tensor1"], args["tensor2"]
    out = tuple(c.shape(n))
    param = functools.partial(_param_like, c)
    if param(t1):
        t1, t2 = t2, t1
    if param(t1) or not c.is_node(t1) or tuple(c.shape(t1)) != out:
        raise UnsupportedOpError(
            c.describe(n, "multiplies two parameters, or broadcasts an activation")
        )
    if param(t2):
        seen, view = _param_seen(c, n, t2, out, "multiplies")
        g = c.get_param(view.source if view is not None else t2, "scale")
        product = c.emit_as(Op.MUL, [c.arg(t1), g], out, view=seen)
    elif tuple(c.shape(t2)) == out:
        product = c.emit_as(Op.MUL, [c.arg(t1), c.arg(t2)], out)
    else:
        raise UnsupportedOpError(c.describe(n, "multiplies tensors of different shapes"))
    k = static_value(args.get("value", 1))
    if k != 1:
        product = scaled(c, product, out, float(k))
    if param(base):
        return _add_parameter(c, n, base, product, out)
    if not c.is_node(base) or tuple(c.shape(base)) != out:
        raise UnsupportedOpError(c.describe(n, "adds a product to a tensor of another shape"))
    return c.emit(Op.ADD, [c.arg(base), product], n)


def _concat_tensors(c: Any, n: Any) -> Value:
    """torch.cat / torch.concat(tensors, dim): a single tensor is itself."""
    items = n.args[0] if n.args else n.kwargs["tensors"]
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    if not isinstance(items, (list, tuple)) or not all(c.is_node(t) for t in items):
        raise UnsupportedOpError(c.describe(n, "concatenates something other than tensors"))
    if len(items) == 1:
        return c.arg(items[0])
    rank = len(c.shape(n))
    d = static_int(dim) % rank
    if rank < 2 or d == c.first_or_batch_axis(c.arg(items[0])):
        raise UnsupportedOpError(
            c.describe(n, "concatenates along the batch axis; concatenate along a feature axis")
        )
    return c.emit(Op.CONCAT, [c.arg(t) for t in items], n, dim=d)


def _stack(c: Any, n: Any) -> Value:
    """torch.stack(tensors, dim) of activations along a new non-batch axis: each seen with an
    axis of 1 there, then concatenated (EVA's rotary embedding: stack([-x[..., 1::2],
    x[..., ::2]], -1))."""
    args = dict(zip(("tensors", "dim"), n.args)) | dict(n.kwargs)
    items = args["tensors"]
    if not isinstance(items, (list, tuple)) or not all(c.is_node(t) for t in items):
        raise UnsupportedOpError(c.describe(n, "stacks something other than tensors"))
    out = tuple(c.shape(n))
    d = static_int(args.get("dim", 0)) % len(out)
    batch = c.first_or_batch_axis(c.arg(items[0]))
    if batch > 0 and d <= batch:  # a reshape would merge the new axis with those before
        raise UnsupportedOpError(
            c.describe(
                n,
                f"stacks along a new axis before the batch axis ({batch}), which is not the "
                "first; stack along a later axis, or move the batch axis first",
            )
        )
    one = (*out[:d], 1, *out[d + 1 :])
    pieces = [reshaped(c, c.arg(t), one) for t in items]
    return pieces[0] if len(pieces) == 1 else c.emit(Op.CONCAT, pieces, n, dim=d)


def _roll(c: Any, n: Any) -> Value:
    """torch.roll(x, shifts, dims) along non-batch axes (Swin's shifted windows): per axis the
    last `shift` rows concatenated before the others (two slices of one tensor, so of one
    exponent: the concatenation is exact)."""
    args = dict(zip(("input", "shifts", "dims"), n.args)) | dict(n.kwargs)
    shifts, dims = static_value(args.get("shifts")), static_value(args.get("dims"))
    if dims is None or dims == ():
        raise UnsupportedOpError(c.describe(n, "rolls the flattened tensor; name the axes"))
    shifts = list(shifts) if isinstance(shifts, (tuple, list)) else [shifts]
    dims = list(dims) if isinstance(dims, (tuple, list)) else [dims]
    shape = tuple(c.shape(args["input"]))
    v = c.arg(args["input"])
    for shift, dim in zip(shifts, dims):
        d = int(dim) % len(shape)
        rows = shape[d]
        k = int(shift) % rows
        if k == 0:
            continue
        if d == c.first_or_batch_axis(v):
            raise UnsupportedOpError(c.describe(n, "rolls the batch axis"))
        tail = (*shape[:d], k, *shape[d + 1 :])
        head = (*shape[:d], rows - k, *shape[d + 1 :])
        pieces = [
            c.emit_as(Op.SLICE, [v], tail, dim=d, start=rows - k, stop=rows),
            c.emit_as(Op.SLICE, [v], head, dim=d, start=0, stop=rows - k),
        ]
        v = c.emit_as(Op.CONCAT, pieces, shape, dim=d)
    return v


def _narrow(c: Any, n: Any) -> Value:
    """x.narrow(dim, start, length) / torch.narrow: x[..., start : start + length, ...] along a
    non-batch axis, a SLICE."""
    args = dict(zip(("input", "dim", "start", "length"), n.args)) | dict(n.kwargs)
    shape = tuple(c.shape(args["input"]))
    dim, start, length = (static_int(args[k]) for k in ("dim", "start", "length"))
    dim %= len(shape)
    start %= shape[dim]
    v = c.arg(args["input"])
    if dim == c.first_or_batch_axis(v):
        raise UnsupportedOpError(c.describe(n, "narrows the batch axis"))
    return sliced(c, v, shape, dim, start, start + length)


def _unfold(c: Any, n: Any) -> Value:
    """x.unfold(dim, size, step): the windows x[..., i*step : i*step + size, ...] along a new
    axis at dim, the window's elements last (HaloNet's overlapping key blocks). With dim moved
    last, the windows are slices concatenated (pieces of one tensor: one exponent, exact),
    seen as (windows, size) and moved back; windows that tile the axis are a reshape."""
    args = dict(zip(("input", "dimension", "size", "step"), n.args)) | dict(n.kwargs)
    shape = tuple(c.shape(args["input"]))
    rank = len(shape)
    d = static_int(args["dimension"]) % rank
    size, step = static_int(args["size"]), static_int(args["step"])
    x = c.arg(args["input"])
    if c.batch_axis(x) == d:
        raise UnsupportedOpError(c.describe(n, "unfolds the batch axis"))
    count = (shape[d] - size) // step + 1
    perm = (*(a for a in range(rank) if a != d), d)
    rest = tuple(shape[a] for a in perm[:-1])
    v = x if d == rank - 1 else transposed(c, x, shape, perm)
    moved, last = (*rest, shape[d]), rank - 1
    if step == size:
        if count * size != shape[d]:
            v = sliced(c, v, moved, last, 0, count * size)
    else:
        pieces = [sliced(c, v, moved, last, i * step, i * step + size) for i in range(count)]
        v = concatenated(c, pieces, (*rest, count * size), last)
    v = reshaped(c, v, (*rest, count, size))
    if d == last:
        return v
    back = (*range(d), last, *range(d, last), rank)  # the windows' axis to dim
    return transposed(c, v, (*rest, count, size), back)


def _param_over_batch(c: Any, n: Any, x: Any) -> Value | None:
    """EXPAND_PARAM where n repeats x, a [1, ...] parameter or a parameter seen whole with a
    leading axis of 1 (`p.unsqueeze(0)`, `p[None]`, `p.view(1, *p.shape)`), over the batch: a
    class token, Perceiver's latents, DETR's queries. None where x is not one."""
    out, shape = tuple(c.shape(n)), tuple(c.shape(x))
    if not c.is_node(x) or shape != (1, *out[1:]) or out[0] != c.batch:
        return None
    if c.is_param(x):
        return c.emit(Op.EXPAND_PARAM, [c.get_param(x, "embedding")], n)
    view = c.param_view(x)
    if view is None or int(np.prod(c.shape(view.source))) != int(np.prod(shape)):
        return None
    return c.emit(Op.EXPAND_PARAM, [c.get_param(view.source, "embedding")], n)


def repeated_param(c: Any, a: Any, held: Gathered) -> Value | None:
    """EXPAND_PARAM where `held`, node a's value, is a whole parameter repeated over the batch
    in its own order (`p.unsqueeze(0).expand(B, -1, -1)`, `p[None].repeat(B, 1, 1)`: Perceiver's
    latents, DETR's queries, which the frontend folds into an index map) and read as an
    activation; None where it is not one. Along a batch axis that is not the first (DETR's
    sequence-first `p.unsqueeze(1).repeat(1, B, 1)`), repeated first and moved there."""
    axis = repeated_param_axis(c, held)
    if axis is None:
        return None
    shape = tuple(held.index.shape)
    first = (shape[axis], *shape[:axis], *shape[axis + 1 :])
    v = c.emit_as(Op.EXPAND_PARAM, [c.get_param(held.source, "embedding")], first)
    if axis == 0:
        return v
    perm = (*range(1, axis + 1), 0, *range(axis + 1, len(shape)))
    return transposed(c, v, first, perm)


def repeated_param_axis(c: Any, held: Any) -> int | None:
    """The axis along which `held`, a Gathered parameter, repeats the whole parameter in its
    own order once per sample (the batch axis); None where it is not one."""
    if not isinstance(held, Gathered) or held.value is not None:
        return None
    shape = held.index.shape
    size = int(np.prod(c.shape(held.source)))
    for axis in range(len(shape) if len(shape) >= 2 else 0):
        if shape[axis] != c.batch:
            continue
        rows = np.moveaxis(held.index, axis, 0).reshape(shape[axis], -1)
        if rows.shape[1] == size and bool((rows == np.arange(size)).all()):
            return axis
    return None


def repeats_whole_param(c: Any, held: Any) -> bool:
    """`held` is a parameter repeated over the batch (repeated_param_axis)."""
    return repeated_param_axis(c, held) is not None


def _expand(c: Any, n: Any) -> Value:
    """param.expand(B, ...) of a [1, ...] parameter over the batch (a class token; a parameter
    seen with a leading 1: _param_over_batch), or an activation's axes of size 1 expanded
    (`broadcast`)."""
    x = n.args[0]
    out = c.shape(n)
    tokens = _param_over_batch(c, n, x)
    if tokens is not None:
        return tokens
    if not c.is_param(x) and broadcastable(tuple(c.shape(x)), tuple(out)):
        return broadcast(c, n, c.arg(x), tuple(c.shape(x)), tuple(out))
    if not c.is_param(x) or c.shape(x)[0] != 1 or tuple(c.shape(x)[1:]) != tuple(out[1:]):
        raise UnsupportedOpError(
            c.describe(
                n,
                "expands something other than a [1, ...] parameter along the batch axis (a "
                "class token); write the broadcast as an op that broadcasts itself",
            )
        )
    return c.emit(Op.EXPAND_PARAM, [c.get_param(x, "embedding")], n)


def lifted_over_batch(p: Any, batch: int) -> Any:
    """p repeated over a new leading batch axis: what mexc.frontend_lift puts before a function
    of a parameter (EXPAND_PARAM, `_lifted`). Runs on torch tensors while shapes propagate."""
    return p.unsqueeze(0).expand(batch, *p.shape)


def _lifted(c: Any, n: Any) -> Value:
    """A parameter repeated over the batch (frontend_lift), read as an activation."""
    return c.emit(Op.EXPAND_PARAM, [c.get_param(n.args[0], "scale")], n)


def _copies_along(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], axis: int, r: int, inner: bool
) -> tuple[Value, tuple[int, ...]]:
    """v (of `shape`) with `axis` repeated r times: whole (tile: the axis seen as (1, L),
    broadcast to (r, L)) or per element (inner, repeat_interleave: (L, 1) to (L, r)); exact
    copies, whose gradient sums them (broadcast's)."""
    pre, size, post = shape[:axis], shape[axis], shape[axis + 1 :]
    one = (*pre, size, 1, *post) if inner else (*pre, 1, size, *post)
    wide = (*pre, size, r, *post) if inner else (*pre, r, size, *post)
    v = broadcast(c, n, reshaped(c, v, one), one, wide)
    out = (*pre, size * r, *post)
    return reshaped(c, v, out), out


def _repeat(c: Any, n: Any) -> Value:
    """x.repeat(*sizes) / x.tile(dims) of an activation along non-batch axes, or along a batch
    axis of size 1 (XCiT's positional encoding, made for one sample and repeated for the
    batch), where tiling is repeat_interleave's copy per element."""
    x = n.args[0]
    sizes = n.args[1:] if not isinstance(n.args[1], (list, tuple)) else n.args[1]
    sizes = [static_int(r) for r in sizes]
    shape = tuple(c.shape(x))
    if getattr(n.target, "__name__", n.target) == "tile":
        sizes = [1] * (len(shape) - len(sizes)) + sizes
    tokens = _param_over_batch(c, n, x) if sizes[1:] == [1] * (len(sizes) - 1) else None
    if tokens is not None:  # self.cls.repeat(B, 1, 1)
        return tokens
    v = c.arg(x)
    batch = c.batch_axis(v)
    if len(sizes) != len(shape) or (batch is not None and sizes[batch] != 1 and shape[batch] != 1):
        raise UnsupportedOpError(
            c.describe(n, f"repeats {list(shape)} by {sizes}: along the batch axis or new axes")
        )
    for axis, r in enumerate(sizes):
        if r != 1:
            v, shape = _copies_along(c, n, v, shape, axis, r, inner=axis == batch)
    return v


def _repeat_interleave(c: Any, n: Any) -> Value:
    """x.repeat_interleave(r, dim) / torch.repeat_interleave of an activation with a number of
    repeats (grouped-query attention's keys; along the batch axis, each sample's rows repeated
    for its windows merged into the batch: GCViT's global queries)."""
    args = dict(zip(("input", "repeats", "dim"), n.args)) | dict(n.kwargs)
    r, dim = static_value(args["repeats"]), static_value(args.get("dim"))
    shape = tuple(c.shape(args["input"]))
    if not isinstance(r, int) or dim is None:
        raise UnsupportedOpError(
            c.describe(n, "repeats by a tensor of counts or over the flattened tensor")
        )
    axis = int(dim) % len(shape)
    v = c.arg(args["input"])
    return v if r == 1 else _copies_along(c, n, v, shape, axis, r, inner=True)[0]


def broadcast(c: Any, n: Any, v: Value, src: tuple[int, ...], dst: tuple[int, ...]) -> Value:
    """An activation of shape `src` broadcast to `dst` (its axes of size 1 repeated; the batch
    axis and the rank stay): per run of broadcast axes, v seen as (A, 1, 1, B) is upsampled
    by the run's size along its third axis, nearest (exact copies), then seen as the wider
    shape. The upsampling's gradient sums each block of copies, which is the broadcast's.
    Squeeze-and-excitation gates ([N, C, 1, 1]) broadcast inside mul itself; this serves the
    others: spatial gates [N, 1, H, W] (CBAM, FocalNet), global-context sums, expand_as."""
    if not broadcastable(src, dst):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"broadcasts {list(src)} to {list(dst)}; mexc broadcasts an "
                "activation's axes of size 1, not its batch axis or its rank",
            )  # fmt: skip
        )
    cur = list(src)
    i = 1
    while i < len(cur):
        if cur[i] == dst[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(cur) and cur[j + 1] == 1 and dst[j + 1] != 1:
            j += 1
        lead = int(np.prod(cur[:i], dtype=np.int64))
        tail = int(np.prod(cur[j + 1 :], dtype=np.int64))
        copies = int(np.prod(dst[i : j + 1], dtype=np.int64))
        v = reshaped(c, v, (lead, 1, 1, tail))
        v = c.emit_as(Op.UPSAMPLE_NEAREST, [v], (lead, 1, copies, tail), scale=(copies, 1))
        cur[i : j + 1] = dst[i : j + 1]
        v = reshaped(c, v, tuple(cur))
        i = j + 1
    return v


def broadcastable(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    return len(src) == len(dst) and src[0] == dst[0] and all(a in (1, b) for a, b in zip(src, dst))


def as_rows_2d(c: Any, x: Any) -> Value:
    """(N, C, L) seen as (N, C, 1, L): the 1-D layers run as the 2-D ops over one row."""
    b, ch, length = c.shape(x)
    return c.emit_as(Op.RESHAPE, [c.arg(x)], (b, ch, 1, length), shape=(b, ch, 1, length))


def reshaped(c: Any, v: Value, shape: tuple[int, ...]) -> Value:
    """v seen as `shape` (a step of a decomposition)."""
    return c.emit_as(Op.RESHAPE, [v], shape, shape=shape)


def scaled(c: Any, v: Value, shape: tuple[int, ...], value: float) -> Value:
    """v times a host constant (a step of a decomposition: SELU's lambda, a divisor ratio)."""
    return c.emit_as(Op.SCALE, [v], shape, value=float(value))


def sliced(c: Any, v: Value, shape: tuple[int, ...], dim: int, start: int, stop: int) -> Value:
    """v (of `shape`) at [start, stop) along `dim` (a step of a decomposition)."""
    out = (*shape[:dim], stop - start, *shape[dim + 1 :])
    return c.emit_as(Op.SLICE, [v], out, dim=dim, start=start, stop=stop)


def every_nth(
    c: Any, v: Value, shape: tuple[int, ...], dim: int, step: int, first: int = 0
) -> tuple[Value, tuple[int, ...]]:
    """Elements first, first + step, ... of v along `dim` (first < step), and their shape:
    v padded with zeros to a multiple of step (a `pad`, where the size is not one), seen as
    (size / step, step), column `first` of each group sliced out, seen without it. Strided
    slices (x[:, ::2]), a stride applied after the fact, the middle of resampling windows."""
    size = shape[dim]
    kept = -(-size // step)
    if kept * step != size:
        shape = (*shape[:dim], kept * step, *shape[dim + 1 :])
        v = c.emit_as(Op.PAD, [v], shape, dim=dim, start=0, stop=size)
    grouped = (*shape[:dim], kept, step, *shape[dim + 1 :])
    v = sliced(c, reshaped(c, v, grouped), grouped, dim + 1, first, first + 1)
    out = (*shape[:dim], kept, *shape[dim + 1 :])
    return reshaped(c, v, out), out


def added(c: Any, a: Value, b: Value, shape: tuple[int, ...]) -> Value:
    """a + b of one shape (a step of a decomposition)."""
    return c.emit_as(Op.ADD, [a, b], shape)


def param_added(c: Any, v: Value, p: Value, shape: tuple[int, ...], view: tuple[int, ...]) -> Value:
    """v + a parameter seen as `view` (broadcast against v's shape): a step of a
    decomposition."""
    return c.emit_as(Op.ADD_PARAM, [v, p], shape, view=view)


def subtracted(c: Any, n: Any, a: Value | float, b: Value | float, shape: tuple[int, ...]) -> Value:
    """a - b of values of `shape`, or of one and a number (a step of a decomposition): a + (-1)
    b, a number added as a constant (number_added; 0 adds nothing)."""
    if not isinstance(b, Value):
        assert isinstance(a, Value)
        return number_added(c, n, a, shape, -b)
    negated = scaled(c, b, shape, -1.0)
    return (
        number_added(c, n, negated, shape, a)
        if not isinstance(a, Value)
        else added(c, a, negated, shape)
    )


def concatenated(c: Any, parts: list[Value], shape: tuple[int, ...], dim: int) -> Value:
    """parts concatenated along `dim` into `shape` (a step of a decomposition)."""
    return c.emit_as(Op.CONCAT, parts, shape, dim=dim)


def multiplied(c: Any, v: Value, factor: Value, shape: tuple[int, ...]) -> Value:
    """v times a factor that broadcasts along its own run of axes (a parameter per channel),
    a step of a decomposition."""
    return c.emit_as(Op.MUL, [v, factor], shape)


def interleaved(c: Any, parts: list[Value], shape: tuple[int, ...], dim: int) -> Value:
    """parts (each of `shape`) interleaved along `dim`: element i of part r at i * len(parts)
    + r (each seen with an axis of 1 after dim, concatenated there, the two axes merged)."""
    one = (*shape[: dim + 1], 1, *shape[dim + 1 :])
    wide = (*shape[: dim + 1], len(parts), *shape[dim + 1 :])
    v = concatenated(c, [reshaped(c, p, one) for p in parts], wide, dim + 1)
    return reshaped(c, v, (*shape[:dim], shape[dim] * len(parts), *shape[dim + 1 :]))


def transposed(c: Any, v: Value, shape: tuple[int, ...], perm: tuple[int, ...]) -> Value:
    """v (of `shape`) with its axes permuted (a step of a decomposition)."""
    return c.emit_as(Op.TRANSPOSE, [v], tuple(shape[a] for a in perm), perm=perm)


def as_result(c: Any, n: Any, v: Value) -> Value:
    """v reshaped to n's traced result (the (N, C, 1, L') of a 1-D layer's 2-D op as its
    (N, C, L'), the last step of a decomposition)."""
    return c.emit(Op.RESHAPE, [v], n, shape=tuple(c.shape(n)))


def _reshape_to_result(c: Any, n: Any, m: Any = None) -> Value | ParamView:
    if m is None and c.is_param(n.args[0]):
        return ParamView(n.args[0], tuple(c.shape(n)))  # read by the op that takes it
    return c.emit(Op.RESHAPE, [c.arg(n.args[0])], n, shape=c.shape(n))


def _drop_rate(c: Any, n: Any, p: Any) -> float:
    """A dropout probability mexc's inverted dropout takes: 0 <= p < 1 (it scales the kept
    elements by 1 / (1 - p))."""
    rate = float(p)
    if not 0.0 <= rate < 1.0:
        raise UnsupportedOpError(
            c.describe(n, f"drops with probability {p!r}; mexc takes 0 <= p < 1")
        )
    return rate


def _dropout_module(c: Any, n: Any, m: Any) -> Value:
    if _drop_rate(c, n, m.p) == 0.0:
        return c.arg(n.args[0])
    return c.emit(Op.DROPOUT, [c.arg(n.args[0])], n, p=float(m.p))


def _dropout_function(c: Any, n: Any) -> Value:
    p = _drop_rate(c, n, n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5))
    if p == 0.0:
        return c.arg(n.args[0])
    return c.emit(Op.DROPOUT, [c.arg(n.args[0])], n, p=p)


def _channel_dropout(c: Any, n: Any, x: Any, p: float) -> Value:
    """Dropout1d / 2d / 3d: whole channels of each sample kept or zeroed (mode "channel")."""
    if len(c.shape(x)) < 3:
        raise UnsupportedOpError(
            c.describe(n, "drops channels of an unbatched or 2-D input; give it (N, C, ...)")
        )
    if p == 0.0:
        return c.arg(x)
    return c.emit(Op.DROPOUT, [c.arg(x)], n, p=p, mode="channel")


def _channel_dropout_module(c: Any, n: Any, m: Any) -> Value:
    return _channel_dropout(c, n, n.args[0], _drop_rate(c, n, m.p))


def _channel_dropout_function(c: Any, n: Any) -> Value:
    p = _drop_rate(c, n, n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5))
    return _channel_dropout(c, n, n.args[0], p)


def _stochastic_depth(c: Any, n: Any) -> Value:
    """torchvision.ops.stochastic_depth(x, p, mode, training): whole samples (mode "row") or
    the whole batch ("batch") dropped with probability p in training, as torchvision does when
    the module trains; the traced `training` flag is that of tracing (eval), not of the step."""
    args = dict(zip(("input", "p", "mode", "training"), n.args)) | dict(n.kwargs)
    p, mode = float(args["p"]), str(args["mode"])
    if mode not in ("row", "batch"):
        raise UnsupportedOpError(c.describe(n, f"uses stochastic depth mode {mode!r}"))
    if p == 0.0:
        return c.arg(args["input"])
    if p >= 1.0:
        raise UnsupportedOpError(c.describe(n, "drops every path (p = 1)"))
    return c.emit(Op.DROPOUT, [c.arg(args["input"])], n, p=p, mode=mode)


def _drop_path_module(c: Any, n: Any, m: Any) -> Value:
    """timm's DropPath(drop_prob, scale_by_keep): stochastic depth per sample."""
    if _drop_rate(c, n, m.drop_prob) == 0.0:
        return c.arg(n.args[0])
    if not m.scale_by_keep:
        raise UnsupportedOpError(c.describe(n, "drops paths without rescaling (scale_by_keep)"))
    return c.emit(Op.DROPOUT, [c.arg(n.args[0])], n, p=float(m.drop_prob), mode="row")


def _scale_by(c: Any, n: Any, divide: bool) -> Value:
    a, b = n.args[0], n.args[1]
    x, k = (a, b) if c.is_node(a) else (b, a)
    if divide and x is a:
        k = 1.0 / float(k)
    if not c.is_node(x) or not isinstance(k, (int, float)):
        raise UnsupportedOpError(
            c.describe(n, "multiplies two tensors; only tensor * constant is supported")
        )
    if float(k) == 0 or not math.isfinite(float(k)):
        raise UnsupportedOpError(
            c.describe(n, f"scales by {k}; mexc scales by finite nonzero constants")
        )
    return c.emit(Op.SCALE, [c.arg(x)], n, value=float(k))


def number_added(c: Any, n: Any, v: Value, shape: tuple[int, ...], k: Any) -> Value:
    """v + a Python number: add_param of a constant [1] (seen as (1, ..., 1)), which the
    compiler never trains: the number is held as an int8 mantissa at its own exponent, so a
    dyadic one (0.5, 1, 3) is exact and another is rounded to 7 significant bits (0.1 as
    0.0996)."""
    if not finite_number(k):
        raise UnsupportedOpError(c.describe(n, f"adds {k!r}; mexc adds finite numbers"))
    if tuple(c.shape(n)) != shape:
        raise UnsupportedOpError(c.describe(n, "adds a number that broadcasts the tensor wider"))
    if k == 0:
        return v
    const = c.constant(f"{n.name}.constant", np.full((1,), float(k)), "bias")
    return c.emit(Op.ADD_PARAM, [v, const], n, view=(1,) * len(shape))


def _sub(c: Any, n: Any) -> Value:
    """a - b: a + (-1) b, the negation a scale by -1 (exact but for a mantissa of -128, which
    the scale's compaction rounds); a - 0 and 0 - b as themselves and -b; a number as in
    _add_number (x - k, k - x); a constant tensor (a buffer: `x - self.mean`) negated on the
    host and added; a parameter p added to -x (p - x, and x - p as -(-x + p))."""
    args = dict(zip(("input", "other", "alpha"), n.args)) | dict(n.kwargs)
    a, b = args["input"], args["other"]
    if args.get("alpha", 1) != 1:
        raise UnsupportedOpError(c.describe(n, "uses alpha != 1"))
    if not c.is_node(b) and b == 0 and c.is_node(a) and c.shape(a) == c.shape(n):
        return c.arg(a)
    if not (c.is_node(a) or c.is_node(b)):
        raise UnsupportedOpError(c.describe(n, "subtracts numbers"))
    out = tuple(c.shape(n))
    minus = folded_constant(c, n, b, out, np.negative) if _is_activation(c, a) else None
    if minus is not None:
        return c.emit(Op.ADD, [broadcast(c, n, c.arg(a), tuple(c.shape(a)), out), minus], n)
    held = folded_constant(c, n, a, out, np.positive) if _is_activation(c, b) else None
    if held is not None:
        negated = scaled(c, c.arg(b), tuple(c.shape(b)), -1.0)
        return c.emit(Op.ADD, [broadcast(c, n, negated, tuple(c.shape(b)), out), held], n)
    for p, x, sign in ((b, a, -1.0), (a, b, 1.0)):
        if _param_like(c, p) and _is_activation(c, x) and tuple(c.shape(x)) == out:
            _param_seen(c, n, p, out, "subtracts")  # refused unless along one run of axes
            negated = scaled(c, c.arg(x), out, -1.0)
            y = _add_parameter(c, n, p, negated, out)
            return y if sign > 0 else c.emit(Op.SCALE, [y], n, value=-1.0)
    if not c.is_node(b):  # x - k = x + (-k)
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise UnsupportedOpError(c.describe(n, f"subtracts {b!r}"))
        return number_added(c, n, c.arg(a), tuple(c.shape(a)), -b)
    shape_b = tuple(c.shape(b))
    if not c.is_node(a):  # k - x = -x + k
        if a == 0:
            return c.emit(Op.SCALE, [c.arg(b)], n, value=-1.0)
        return number_added(c, n, scaled(c, c.arg(b), shape_b, -1.0), shape_b, a)
    negated = scaled(c, c.arg(b), shape_b, -1.0)
    out, shape_a = tuple(c.shape(n)), tuple(c.shape(a))
    if shape_a != shape_b:
        if not (broadcastable(shape_a, out) and broadcastable(shape_b, out)):
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"subtracts {list(shape_b)} from {list(shape_a)}; mexc "
                    "broadcasts axes of size 1 other than the batch axis",
                )  # fmt: skip
            )
        return c.emit(
            Op.ADD,
            [broadcast(c, n, c.arg(a), shape_a, out), broadcast(c, n, negated, shape_b, out)],
            n,
        )
    return c.emit(Op.ADD, [c.arg(a), negated], n)


def _neg(c: Any, n: Any) -> Value:
    return c.emit(Op.SCALE, [c.arg(n.args[0])], n, value=-1.0)


# a * b, for the forms other modules know (norm_written_out: x * torch.rsqrt(...)): each
# returns the product, or None where neither factor is its form
ACTIVATION_FACTORS: list[Callable[[Any, Any, Any, Any], Value | None]] = []


def _mul(c: Any, n: Any) -> Value:
    """tensor * constant (SCALE), or tensor * tensor (MUL): gating by an activation that
    broadcasts (squeeze-and-excitation), a product of equal shapes, or a broadcast parameter
    (layer scale)."""
    a, b = n.args[0], n.args[1]
    if not (c.is_node(a) and c.is_node(b)):
        return _scale_by(c, n, divide=False)
    for multiply in ACTIVATION_FACTORS:
        y = multiply(c, n, a, b)
        if y is not None:
            return y
    if is_gathered(c, a) or is_gathered(c, b):
        return _with_gathered(c, n, Op.MUL)
    out = c.shape(n)
    view = c.param_view(b) or c.param_view(a)
    if view is not None:  # a parameter seen through a reshape
        x = b if c.param_view(a) is not None else a
        if c.shape(x) != out or K.factor_view(out, view.shape) is None:
            raise UnsupportedOpError(
                c.describe(n, f"multiplies by a parameter seen as {list(view.shape)}")
            )
        g = c.get_param(view.source, "scale")
        return c.emit(Op.MUL, [c.arg(x), g], n, view=view.shape)
    if c.shape(a) != out or (c.is_param(a) and not c.is_param(b)):
        a, b = b, a
    both = (tuple(c.shape(a)), tuple(c.shape(b)))
    if (
        not (c.is_param(a) or c.is_param(b))
        and (both[0] != tuple(out) or K.factor_view(out, both[1]) is None)
        and all(broadcastable(sh, tuple(out)) for sh in both)
    ):
        # a spatial gate [N, 1, H, W], or both sides broadcast: the factor (or both) made
        # full-size first
        x = broadcast(c, n, c.arg(a), both[0], tuple(out))
        return c.emit(Op.MUL, [x, broadcast(c, n, c.arg(b), both[1], tuple(out))], n)
    if c.shape(a) != out or c.is_param(a):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"multiplies {list(c.shape(n.args[0]))} by {list(c.shape(n.args[1]))}: both "
                "broadcast, or an activation scales a parameter; one operand must be an "
                "activation of the result's shape",
            )
        )
    if K.factor_view(out, c.shape(b)) is None and c.is_param(b) and not c.is_parameter(b):
        # a constant the trace made (Hugging Face's rotary cos and sin from position ids
        # expanded over the batch: [N, 1, T, D]) is one factor along the axes it varies on
        kept = gaps_filled(uniform_axes_cut(c.fetch(b).detach().cpu().numpy()), tuple(out))
        if K.factor_view(out, kept.shape) is not None:
            return c.emit(Op.MUL, [c.arg(a), c.constant(str(b.target), kept, "scale")], n)
    if K.factor_view(out, c.shape(b)) is None:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"multiplies by a factor of shape {list(c.shape(b))} whose own axes are not "
                f"contiguous in {list(out)}; supported factors vary along one run of axes "
                "([N, C, 1, 1], [C, 1, 1], [C], or the full shape)",
            )
        )
    g = c.get_param(b, "scale") if c.is_param(b) else c.arg(b)
    return c.emit(Op.MUL, [c.arg(a), g], n)


def gaps_filled(values: np.ndarray, out: tuple[int, ...]) -> np.ndarray:
    """Constant `values`, which broadcasts to `out`, repeated along the axes of extent 1 between
    the first and the last it varies on: one factor along one run of axes (a rotary table
    [1, T, 1, D] of queries [N, T, H, D] as [1, T, H, D], H copies). Not over the batch axis:
    a constant that varies along it is left as it is (factor_view refuses it)."""
    pad = values.reshape((1,) * (len(out) - values.ndim) + values.shape)
    own = [i for i, (a, b) in enumerate(zip(out, pad.shape)) if b == a != 1]
    if not own or own[0] == 0 or pad.ndim != len(out):
        return values
    shape = [a if own[0] <= i <= own[-1] else b for i, (a, b) in enumerate(zip(out, pad.shape))]
    return np.ascontiguousarray(np.broadcast_to(pad, shape))


def uniform_axes_cut(values: np.ndarray) -> np.ndarray:
    """`values` with every axis along which it does not change cut to extent 1 (its first
    slice): the same tensor once broadcast back."""
    for axis in range(values.ndim):
        first = np.take(values, [0], axis=axis)
        if values.shape[axis] > 1 and bool((values == first).all()):
            values = first
    return values


def _pow(c: Any, n: Any) -> Value:
    """x ** k, torch.pow(x, k), torch.square(x) for a whole k in 1..4 (StarReLU's relu(x) ** 2):
    k - 1 multiplications of equal shapes (x * x, then by x)."""
    x = n.args[0]
    k = (
        2
        if getattr(n.target, "__name__", n.target) == "square"
        else static_value(n.args[1] if len(n.args) > 1 else n.kwargs.get("exponent"))
    )
    if not c.is_node(x) or isinstance(k, bool) or k not in (1, 2, 3, 4):
        raise UnsupportedOpError(
            c.describe(n, f"raises to the power {k!r}; mexc takes a tensor to a whole power 1..4")
        )
    v, shape = c.arg(x), tuple(c.shape(x))
    y = v
    for i in range(int(k) - 1):
        y = c.emit(Op.MUL, [y, v], n) if i == int(k) - 2 else c.emit_as(Op.MUL, [y, v], shape)
    return y


# a / b of two activations, for the forms other modules know (norm: x / x.norm(...)): each
# returns the quotient, or None where b is not its form
ACTIVATION_DIVISORS: list[Callable[[Any, Any, Any, Any], Value | None]] = []


def _one_number(c: Any, b: Any) -> float | None:
    """The value of b where it is a one-element constant tensor: a buffer or a tensor the
    trace or the host folded (torch.sqrt(torch.tensor(d_k))), not a trained parameter."""
    if not c.is_node(b):
        return None
    held = c.env.get(b)
    if isinstance(held, Const):
        value = np.asarray(held.value, np.float64)
    elif c.is_param(b) and not c.is_parameter(b) and c.param_view(b) is None:
        value = c.fetch(b).detach().double().numpy()
    else:
        return None
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _div_call(c: Any, n: Any) -> Value:
    """torch.div(a, b), a.div(b), true_divide, divide: a / b; a rounding mode is refused."""
    if static_value(n.kwargs.get("rounding_mode")) is not None:
        raise UnsupportedOpError(
            c.describe(n, "divides with a rounding_mode; mexc divides as a / b does")
        )
    return _div(c, n)


def _div(c: Any, n: Any) -> Value:
    a, b = n.args[0], n.args[1]
    if c.is_node(b) and not c.is_node(a):
        raise UnsupportedOpError(
            c.describe(n, f"divides the number {a!r} by a tensor; mexc divides by numbers")
        )
    k = _one_number(c, b)
    if c.is_node(a) and k is not None:
        if k == 0 or not math.isfinite(k) or tuple(c.shape(n)) != tuple(c.shape(a)):
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"divides by the constant {k} of shape {list(c.shape(b))}, which is "
                    "zero or broadcasts the tensor wider; divide by a nonzero number",
                )
            )
        return c.emit(Op.SCALE, [c.arg(a)], n, value=1.0 / k)
    out = tuple(c.shape(n))
    inverse = folded_constant(c, n, b, out, np.reciprocal) if _is_activation(c, a) else None
    if inverse is not None:  # x / self.std: x times the constant's reciprocals
        return c.emit(Op.MUL, [broadcast(c, n, c.arg(a), tuple(c.shape(a)), out), inverse], n)
    if c.is_node(a) and c.is_node(b):
        for divide in ACTIVATION_DIVISORS:
            q = divide(c, n, a, b)
            if q is not None:
                return q
        return _quotient(c, n, a, b)
    return _scale_by(c, n, divide=True)


def divided(c: Any, n: Any, a: Value, b: Value) -> Value:
    """a / b of two activations of n's shape (a step of a decomposition: softsign)."""
    return c.emit(Op.DIV, [a, b], n)


def _quotient(c: Any, n: Any, a: Any, b: Any) -> Value:
    """a / b of two activations (ConvNeXt V2's global response normalization, softsign):
    each broadcast to the result's shape first (broadcast), then `div`."""
    for v in (a, b):
        if c.is_param(v) or c.param_view(v) is not None or is_gathered(c, v):
            raise UnsupportedOpError(
                c.describe(
                    n,
                    "divides with a parameter or a constant tensor as an operand; mexc "
                    "divides an activation by a number or by another activation",
                )
            )
    out = tuple(c.shape(n))
    va, vb = (broadcast(c, n, c.arg(v), tuple(c.shape(v)), out) for v in (a, b))
    return divided(c, n, va, vb)


def detached(c: Any, v: Value, shape: tuple[int, ...]) -> Value:
    """v with no gradient back through it (a step of a decomposition: a comparison's mask)."""
    return c.emit_as(Op.DETACH, [v], shape, shape=shape)


def _detach(c: Any, n: Any) -> Value:
    """x.detach(), torch.detach(x): x, with no gradient back through it (stop-gradient)."""
    x = n.args[0] if n.args else n.kwargs["input"]
    return c.emit(Op.DETACH, [c.arg(x)], n, shape=tuple(c.shape(n)))


def _permute(c: Any, n: Any) -> Value:
    x = n.args[0]
    rank = len(c.shape(x))
    dims = n.args[1:] if not isinstance(n.args[1], (list, tuple)) else n.args[1]
    perm = tuple(static_int(d) % rank for d in dims)
    return c.emit(Op.TRANSPOSE, [c.arg(x)], n, perm=perm)


def _rearrange(c: Any, n: Any, x: Any, split: tuple[int, ...], perm: tuple[int, ...]) -> Value:
    """x reshaped to `split`, permuted by `perm` and reshaped to n's result: the pixel and
    channel shuffles, which only move mantissas (one exponent)."""
    v = c.emit_as(Op.RESHAPE, [c.arg(x)], split, shape=split)
    moved = tuple(split[p] for p in perm)
    v = c.emit_as(Op.TRANSPOSE, [v], moved, perm=perm)
    return c.emit(Op.RESHAPE, [v], n, shape=tuple(c.shape(n)))


def _four_d(c: Any, n: Any, x: Any) -> tuple[int, int, int, int]:
    shape = tuple(c.shape(x))
    if len(shape) != 4:
        raise UnsupportedOpError(
            c.describe(n, f"rearranges a {len(shape)}-D tensor; give it (N, C, H, W)")
        )
    return shape


def _pixel_shuffle(c: Any, n: Any, x: Any, r: int) -> Value:
    """(N, C r^2, H, W) -> (N, C, H r, W r)."""
    b, ch, h, w = _four_d(c, n, x)
    return _rearrange(c, n, x, (b, ch // (r * r), r, r, h, w), (0, 1, 4, 2, 5, 3))


def _pixel_unshuffle(c: Any, n: Any, x: Any, r: int) -> Value:
    """(N, C, H r, W r) -> (N, C r^2, H, W)."""
    b, ch, h, w = _four_d(c, n, x)
    return _rearrange(c, n, x, (b, ch, h // r, r, w // r, r), (0, 1, 3, 5, 2, 4))


def _channel_shuffle(c: Any, n: Any, x: Any, groups: int) -> Value:
    """(N, C, H, W): channel g (C / groups) + i moves to i groups + g (ShuffleNet)."""
    b, ch, h, w = _four_d(c, n, x)
    return _rearrange(c, n, x, (b, groups, ch // groups, h, w), (0, 2, 1, 3, 4))


def _shuffle_module(kind: str) -> Callable[..., Value]:
    def convert(c: Any, n: Any, m: Any) -> Value:
        if kind == "pixel":
            return _pixel_shuffle(c, n, n.args[0], int(m.upscale_factor))
        if kind == "unpixel":
            return _pixel_unshuffle(c, n, n.args[0], int(m.downscale_factor))
        return _channel_shuffle(c, n, n.args[0], int(m.groups))

    return convert


def _shuffle_function(kind: str) -> Callable[..., Value]:
    names = {"pixel": "upscale_factor", "unpixel": "downscale_factor", "channel": "groups"}

    def convert(c: Any, n: Any) -> Value:
        k = static_int(n.args[1] if len(n.args) > 1 else n.kwargs[names[kind]])
        if kind == "pixel":
            return _pixel_shuffle(c, n, n.args[0], k)
        if kind == "unpixel":
            return _pixel_unshuffle(c, n, n.args[0], k)
        return _channel_shuffle(c, n, n.args[0], k)

    return convert


PAD_MODES = ("constant", "reflect", "replicate", "circular")


def _pad(c: Any, n: Any, x: Any, pads: Any, mode: Any = "constant", value: Any = None) -> Value:
    """F.pad as torch takes it (last axis first, (before, after) per axis; negative: cropped).
    A constant other than 0 (EfficientViT's F.pad(v, (0, 1), value=1.0)): zero padding, plus
    a frontend constant holding the value where the padding is (gathered as an activation)."""
    value = static_value(value)
    sizes = [static_int(p) for p in pads]
    if mode == "constant" and value == -math.inf and _max_pooled(c, n, sizes):
        mode = "replicate"  # what max pooling reads of either is the edge's value
    fill = mode == "constant" and value not in (None, 0, 0.0) and any(sizes)
    if mode not in PAD_MODES or (fill and not _padding_value(value, sizes)):
        what = f"mode {mode!r}" if mode != "constant" else f"the value {value!r}"
        raise UnsupportedOpError(
            c.describe(
                n,
                f"pads with {what}; mexc lowers padding with a constant of at most "
                f"{MAX_FILL:g} in size (not cropping with it: the padded tensor has one "
                "exponent, which a larger constant would take from the values; for max "
                "pooling pad with mode 'replicate'), and the modes 'reflect', 'replicate' and "
                "'circular'",
            )
        )
    shape = tuple(c.shape(x))
    y = padded(c, n, c.arg(x), shape, sizes, str(mode))
    if not fill:
        return y
    out = tuple(c.shape(n))
    widths = [(0, 0)] * (len(shape) - len(sizes) // 2)
    widths += [(sizes[2 * i], sizes[2 * i + 1]) for i in reversed(range(len(sizes) // 2))]
    where = np.pad(np.zeros(shape, np.float32), widths, constant_values=float(value))
    fills = gathered_value(c, n, const_gathered(n, where), out)
    return added(c, y, fills, out)


_MAX_POOLS = {
    "max_pool1d": 1,
    "max_pool2d": 2,
    "torch.nn.MaxPool1d": 1,
    "torch.nn.MaxPool2d": 2,
}


def _max_pooled(c: Any, n: Any, sizes: list[int]) -> bool:
    """Every reader of the padded tensor is a max pool (undilated) over the padded axes, each
    pad narrower than the window along its axis (TF's "same" max pooling, timm's
    MaxPool2dSame: F.pad with -inf, then F.max_pool2d). A window that reads padding then also
    reads the edge, so padding with the edge's value (replicate) gives the same maxima, and
    their gradients reach the same element."""
    if not n.users or min(sizes, default=0) < 0:
        return False
    for user in n.users:
        if user.op == "call_module":
            mod = c.gm.get_submodule(str(user.target))
            name = f"torch.nn.{type(mod).__name__}"
            kernel, dilation = getattr(mod, "kernel_size", None), getattr(mod, "dilation", 1)
            own = getattr(mod, "padding", 0)
        elif (name := called_name(user)) in _MAX_POOLS:
            kernel, _, own, opts = pool_call_arguments(user, "max")
            dilation = opts.get("dilation", 1)
        else:
            return False
        rank = _MAX_POOLS.get(name)
        if rank is None or user.args[0] is not n or kernel is None or len(sizes) > 2 * rank:
            return False
        if any(own) if isinstance(own, (tuple, list)) else own != 0:
            return False  # the pool's own padding beside it could make a window all padding
        ks = [kernel] * rank if isinstance(kernel, int) else list(kernel)
        dil = [dilation] * rank if isinstance(dilation, int) else list(dilation or [1] * rank)
        if any(d != 1 for d in dil):
            return False
        # F.pad's sizes run from the last axis back, as the window's axes do reversed
        for i in range(len(sizes) // 2):
            k = int(ks[rank - 1 - i])
            if sizes[2 * i] >= k or sizes[2 * i + 1] >= k:
                return False
    return True


# the largest |value| a constant may fill part of an activation with (F.pad, torch.where):
# the tensor shares one exponent, and a value far beyond its activations' range would leave
# them few bits (a -1e4 before max pooling or a softmax)
MAX_FILL = 8.0


def is_fill(v: Any) -> bool:
    """v is a number mexc fills part of an activation with: finite, at most MAX_FILL."""
    return finite_number(v) and abs(v) <= MAX_FILL


def is_boolean(n: Any) -> bool:
    """Shape propagation recorded n's result as a boolean tensor."""
    return str(getattr(n.meta.get("tensor_meta"), "dtype", "")) == "torch.bool"


def _padding_value(v: Any, sizes: list[int]) -> bool:
    """v is a constant mexc pads with: a fill (is_fill), no crop."""
    return is_fill(v) and min(sizes, default=0) >= 0


def padded(
    c: Any, n: Any, v: Value, shape_in: tuple[int, ...], pads: list[int], mode: str
) -> Value:
    """v padded as F.pad(v, pads, mode) (F.pad's order: last axis first): per axis, a slice
    where it is cropped, then a `pad` (zeros), or the copied rows as width-1 slices (reflect,
    replicate) or two slices (circular) concatenated around it: their gradients sum back
    into v's rows. Conv2d's padding modes go through here too."""
    shape = list(shape_in)
    if len(pads) % 2 or len(pads) // 2 > len(shape) - 1:
        raise UnsupportedOpError(c.describe(n, f"pads {pads}: the batch axis stays as it is"))
    for i in range(len(pads) // 2):
        dim, before, after = len(shape) - 1 - i, pads[2 * i], pads[2 * i + 1]
        if before < 0 or after < 0:
            start, stop = max(-before, 0), shape[dim] - max(-after, 0)
            shape[dim] = stop - start
            v = c.emit_as(Op.SLICE, [v], tuple(shape), dim=dim, start=start, stop=stop)
            before, after = max(before, 0), max(after, 0)
        if not (before or after):
            continue
        inner = shape[dim]
        shape[dim] = inner + before + after
        if mode == "constant":
            v = c.emit_as(Op.PAD, [v], tuple(shape), dim=dim, start=before, stop=before + inner)
            continue
        # torch has checked the widths against the input (reflect: < rows, circular: <=
        # rows); a crop on the other side can leave fewer (torch then reads rows it cropped)
        if max(before, after) > (inner - 1 if mode == "reflect" else inner):
            raise UnsupportedOpError(
                c.describe(n, f"pads {pads} in mode {mode!r}, more rows than the crop leaves")
            )
        pieces = [*_copied_rows(mode, inner, before, True), None]
        pieces += _copied_rows(mode, inner, after, False)

        made: dict[tuple[int, int] | None, Value] = {None: v}  # a replicated row once
        for span in pieces:
            if span is not None and span not in made:
                part = list(shape)
                part[dim] = span[1] - span[0]
                made[span] = c.emit_as(
                    Op.SLICE, [v], tuple(part), dim=dim, start=span[0], stop=span[1]
                )
        v = c.emit_as(Op.CONCAT, [made[s] for s in pieces], tuple(shape), dim=dim)
    return v


def _copied_rows(mode: str, size: int, count: int, before: bool) -> list[tuple[int, int] | None]:
    """The [start, stop) spans of the rows copied before (or after) an axis of `size` rows."""
    if count == 0:
        return []
    if mode == "circular":
        return [(size - count, size)] if before else [(0, count)]
    if mode == "replicate":
        edge = 0 if before else size - 1
        return [(edge, edge + 1)] * count
    rows = range(count, 0, -1) if before else range(size - 2, size - 2 - count, -1)
    return [(r, r + 1) for r in rows]  # reflect: the edge row itself is not repeated


def _pad_function(c: Any, n: Any) -> Value:
    args = dict(zip(("input", "pad", "mode", "value"), n.args)) | dict(n.kwargs)
    return _pad(c, n, args["input"], args["pad"], args.get("mode", "constant"), args.get("value"))


# the padding modules' modes, by their class names' prefixes (ZeroPad, ConstantPad: constant)
_PAD_MODULE_MODES = (
    ("Reflection", "reflect"),
    ("Replication", "replicate"),
    ("Circular", "circular"),
)


def _pad_module(c: Any, n: Any, m: Any) -> Value:
    name = type(m).__name__
    mode = next((k for p, k in _PAD_MODULE_MODES if name.startswith(p)), "constant")
    return _pad(c, n, n.args[0], m.padding, mode, getattr(m, "value", 0))


def _transpose_two(c: Any, n: Any) -> Value:
    x = n.args[0]
    rank = len(c.shape(x))
    d0, d1 = static_int(n.args[1]) % rank, static_int(n.args[2]) % rank
    order = list(range(rank))
    order[d0], order[d1] = order[d1], order[d0]
    return c.emit(Op.TRANSPOSE, [c.arg(x)], n, perm=tuple(order))


def _t(c: Any, n: Any) -> Value:
    """x.t(), torch.t(x): a 2-D tensor's transpose; a 0-D or 1-D tensor as it is."""
    x = n.args[0] if n.args else n.kwargs["input"]
    if len(c.shape(x)) < 2:
        return c.arg(x)
    return c.emit(Op.TRANSPOSE, [c.arg(x)], n, perm=(1, 0))


def _mean(c: Any, n: Any) -> Value:
    return _reduce(c, n, "mean")


def _sum(c: Any, n: Any) -> Value:
    """x.sum(dims) over non-batch axes: their mean times the count (a scale; exact for a
    power of two, ResNeSt's radix 2)."""
    return _reduce(c, n, "sum")


def _reduce(c: Any, n: Any, kind: str) -> Value:
    """x.mean(dims, keepdim) over any non-batch axes: the spatial axes of [N, C, H, W] are a
    global average pool; other axes are moved behind the batch axis and flattened, [B, R, K],
    for the mean over tokens (R = the reduced elements), then reshaped to the result. A sum
    is that mean scaled by R."""
    x = n.args[0]
    shape = c.shape(x)
    rank = len(shape)
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if dim is None or n.kwargs.get("dtype") is not None:
        raise UnsupportedOpError(c.describe(n, f"takes a {kind} without dims; name the axes"))
    axes = static_value(dim)
    axes = axes if isinstance(axes, (list, tuple)) else [axes]
    dims = sorted({static_int(d) % rank for d in axes})
    v = c.arg(x)
    out = tuple(c.shape(n))
    if kind == "sum":
        return summed_over(c, n, v, tuple(shape), dims, out)
    batch = _per_sample_batch(c, n, v, tuple(shape), dims, kind)
    return _mean_batch_elsewhere(c, v, tuple(shape), dims, batch, out)


def _per_sample_batch(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], dims: list[int], kind: str
) -> int:
    """v's batch axis, where a `kind` (mean, sum) over `dims` keeps it; else an error naming n.
    A batch of one may sit on any axis of extent 1 that a reshape merged (torch.stack's new
    first axis): the first such axis outside `dims`."""
    batch = c.first_or_batch_axis(v)
    if batch in dims and c.batch == 1:
        batch = next((a for a, d in enumerate(shape) if d == 1 and a not in dims), batch)
    if batch in dims:
        raise UnsupportedOpError(
            c.describe(
                n, f"takes a {kind} over the batch axis; only per-sample {kind}s are supported"
            )
        )
    return int(batch)


def summed_over(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], dims: list[int], out: tuple[int, ...]
) -> Value:
    """The sum of v (of `shape`) over the non-batch axes `dims` (sorted), as a value of shape
    `out`: their mean times the count (x.sum, an einsum's sum)."""
    batch = _per_sample_batch(c, n, v, shape, dims, "sum")
    count = int(np.prod([shape[d] for d in dims]))
    if count == 1:
        return reshaped(c, v, out)
    return scaled(c, _mean_batch_elsewhere(c, v, shape, dims, batch, out), out, count)


def _mean_batch_elsewhere(
    c: Any, v: Value, shape: tuple[int, ...], dims: list[int], batch: int, out: tuple[int, ...]
) -> Value:
    """mean_over for a value whose batch axis is `batch` (a time-first (T, N, H) sequence's
    mean over time): the batch moved first, the mean, the kept axes back in their order."""
    if batch == 0:
        return mean_over(c, v, shape, dims, out)
    rank = len(shape)
    perm = (batch, *(a for a in range(rank) if a != batch))
    v = transposed(c, v, shape, perm)
    ours = [batch, *(a for a in range(rank) if a != batch and a not in dims)]
    kept = [a for a in range(rank) if a not in dims]
    mid = tuple(shape[a] for a in ours)
    y = mean_over(c, v, tuple(shape[p] for p in perm), sorted(perm.index(d) for d in dims), mid)
    if ours != kept:
        y = transposed(c, y, mid, tuple(ours.index(a) for a in kept))
        mid = tuple(shape[a] for a in kept)
    return y if mid == out else reshaped(c, y, out)


def mean_over(
    c: Any, v: Value, shape: tuple[int, ...], dims: list[int], out: tuple[int, ...]
) -> Value:
    """The mean of v (of `shape`) over `dims`, as a value of shape `out`."""
    rank = len(shape)
    if rank == 4 and dims == [2, 3]:
        y = c.emit_as(Op.GLOBAL_AVGPOOL, [v], (shape[0], shape[1], 1, 1))
        return y if out == (shape[0], shape[1], 1, 1) else reshaped(c, y, out)
    kept = [d for d in range(1, rank) if d not in dims]
    perm = (0, *dims, *kept)
    if perm != tuple(range(rank)):
        v = c.emit_as(Op.TRANSPOSE, [v], tuple(shape[p] for p in perm), perm=perm)
    r = int(np.prod([shape[d] for d in dims]))
    k = int(np.prod([shape[d] for d in kept]))
    if (shape[0], r, k) != tuple(shape[p] for p in perm):
        v = c.emit_as(Op.RESHAPE, [v], (shape[0], r, k), shape=(shape[0], r, k))
    y = c.emit_as(Op.MEAN_TOKENS, [v], (shape[0], k))
    return y if out == (shape[0], k) else reshaped(c, y, out)


define(
    OpDef(
        Op.ADD,
        {"rid": -1, "shift_cap": None},
        types=elementwise_types,
        keeps_axes=True,
        vjp=_add_vjp,
        reference=_add,
        frontend=(
            Pattern("function", ("operator.add", "torch.add", "operator.iadd"), _add_any),
            Pattern("function", ("torch.addcmul",), _addcmul),
            Pattern("method", ("add",), _add_any),
        ),
        lower={"tir": tir_rule("grad_sum"), "c": "emit:_add"},
        aligned_sum=True,
        doc="sum of two activations (residual), aligned to the larger exponent",
        data_parallel=True,
    ),
    OpDef(
        Op.GRAD_SUM,
        {"rid": -1, "shift_cap": None},
        reference=_grad_sum,
        lower={"tir": tir_rule("grad_sum"), "c": "emit:_grad_sum"},
        aligned_sum=True,
        doc="sum of the gradients of a value read by several ops",
        data_parallel=True,
    ),
    OpDef(
        Op.RESHAPE,
        {"shape": ()},
        types=elementwise_types,
        vjp=_reshape_vjp,
        reference=_reshape,
        frontend=(
            Pattern("module", ("torch.nn.Flatten",), _reshape_to_result),
            Pattern(
                "function",
                ("torch.flatten", "torch.reshape", "torch.squeeze", "torch.unsqueeze"),
                _reshape_to_result,
            ),
            Pattern(
                "method",
                ("view", "reshape", "flatten", "view_as", "reshape_as", "squeeze", "unsqueeze"),
                _reshape_to_result,
            ),
            Pattern("method", ("repeat", "tile"), _repeat),
            Pattern("function", ("torch.tile",), _repeat),
            Pattern("method", ("repeat_interleave",), _repeat_interleave),
            Pattern("function", ("torch.repeat_interleave",), _repeat_interleave),
        ),
        lower={"tir": tir_rule("reshape"), "c": "emit:_reshape"},
        in_place=True,
        view=True,
        doc="a view of the same mantissas",
        moves_batch=reshaped_batch_axis,
    ),
    OpDef(
        Op.DETACH,
        {"shape": ()},
        types=elementwise_types,
        reference=_reshape,
        frontend=(
            Pattern("method", ("detach",), _detach),
            Pattern("function", ("torch.detach",), _detach),
        ),
        lower={"tir": tir_rule("reshape"), "c": "emit:_reshape"},
        in_place=True,
        view=True,
        no_grad=True,
        doc="x.detach(): a view of the same mantissas through which no gradient flows",
        moves_batch=reshaped_batch_axis,
    ),
    OpDef(
        Op.DROPOUT,
        {"p": 0.5, "mode": "element", "rid": -1},
        types=with_index_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.DROPOUT_GRAD, lambda n: n.result(1)),
        reference=_dropout,
        frontend=(
            Pattern("module", ("torch.nn.Dropout",), _dropout_module),
            Pattern("function", ("torch.nn.functional.dropout",), _dropout_function),
            Pattern(
                "function",
                ("torchvision.ops.stochastic_depth.stochastic_depth",),
                _stochastic_depth,
            ),
            Pattern("module", ("timm.layers.drop.DropPath",), _drop_path_module),
            Pattern(
                "module",
                ("torch.nn.Dropout1d", "torch.nn.Dropout2d", "torch.nn.Dropout3d"),
                _channel_dropout_module,
            ),
            Pattern(
                "function",
                (
                    "torch.nn.functional.dropout1d",
                    "torch.nn.functional.dropout2d",
                    "torch.nn.functional.dropout3d",
                ),
                _channel_dropout_function,
            ),
        ),
        lower={
            "tir": tir_rule("dropout"),
            "tir_eval": tir_rule("dropout_eval"),
            "c": "emit:_dropout",
        },
        doc="inverted dropout, Dropout2d (one keep decision per channel) or stochastic depth "
        "(per sample), from the PRNG",
        data_parallel=True,
    ),
    OpDef(
        Op.DROPOUT_GRAD,
        {"p": 0.5, "rid": -1},
        reference=_dropout_grad,
        lower={"tir": tir_rule("dropout_grad"), "c": "emit:_dropout_grad"},
        doc="dy masked and scaled by the forward mask",
        data_parallel=True,
    ),
    OpDef(
        Op.SCALE,
        {"value": 1.0, "rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=pointwise_vjp(Op.SCALE_GRAD, no_saved),
        reference=_scale,
        frontend=(
            Pattern("function", ("operator.truediv", "operator.itruediv"), _div),
            Pattern("function", ("torch.div", "torch.true_divide", "torch.divide"), _div_call),
            Pattern("method", ("div", "true_divide", "divide"), _div_call),
            Pattern("function", ("operator.sub", "torch.sub", "operator.isub"), _sub),
            Pattern("method", ("sub",), _sub),
            Pattern("function", ("operator.neg", "torch.neg"), _neg),
            Pattern("method", ("neg",), _neg),
        ),
        lower={"tir": tir_rule("scale"), "c": "emit:_scale"},
        doc="x times a host constant of either sign, as a numerator/shift pair (a - b is "
        "a + (-1) b)",
        data_parallel=True,
    ),
    OpDef(
        Op.SCALE_GRAD,
        {"value": 1.0, "rid": -1},
        reference=_scale_grad,
        lower={"tir": tir_rule("scale_grad"), "c": "emit:_scale"},
        doc="dy times the same constant",
        data_parallel=True,
    ),
    OpDef(
        Op.TRANSPOSE,
        {"perm": ()},
        types=elementwise_types,
        vjp=_transpose_vjp,
        reference=_transpose,
        frontend=(
            Pattern("function", ("torch.permute",), _permute),
            Pattern("method", ("permute",), _permute),
            Pattern(
                "function", ("torch.transpose", "torch.swapaxes", "torch.swapdims"), _transpose_two
            ),
            Pattern("method", ("transpose", "swapaxes", "swapdims"), _transpose_two),
            Pattern("function", ("torch.t",), _t),
            Pattern("method", ("t",), _t),
            Pattern("module", ("torch.nn.PixelShuffle",), _shuffle_module("pixel")),
            Pattern("module", ("torch.nn.PixelUnshuffle",), _shuffle_module("unpixel")),
            Pattern("module", ("torch.nn.ChannelShuffle",), _shuffle_module("channel")),
            Pattern(
                "function",
                ("torch.pixel_shuffle", "torch.nn.functional.pixel_shuffle"),
                _shuffle_function("pixel"),
            ),
            Pattern(
                "function",
                ("torch.pixel_unshuffle", "torch.nn.functional.pixel_unshuffle"),
                _shuffle_function("unpixel"),
            ),
            Pattern(
                "function",
                ("torch.channel_shuffle", "torch.nn.functional.channel_shuffle"),
                _shuffle_function("channel"),
            ),
        ),
        lower={"tir": tir_rule("transpose"), "c": "emit:_transpose"},
        doc="axis permutation of the mantissas",
        moves_batch=transposed_batch_axis,
    ),
    OpDef(
        Op.SLICE,
        {"dim": 0, "start": 0, "stop": 0},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.SLICE_GRAD, no_saved),
        reference=_slice,
        frontend=(
            Pattern("method", ("unfold",), _unfold),
            Pattern("method", ("narrow",), _narrow),
            Pattern("function", ("torch.narrow",), _narrow),
        ),
        lower={"tir": tir_rule("slice"), "c": "emit:_slice"},
        doc="[start, stop) along one axis (the frontend makes it from chunk, unfold)",
        moves_batch=sliced_batch_axis,
    ),
    OpDef(
        Op.PAD,
        {"dim": 0, "start": 0, "stop": 0},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.SLICE, no_saved),
        reference=_slice_grad,  # x placed into zeros: the slice's gradient, and its kernels
        frontend=(
            Pattern("function", ("torch.nn.functional.pad",), _pad_function),
            Pattern(
                "module",
                (
                    "torch.nn.ZeroPad1d",
                    "torch.nn.ZeroPad2d",
                    "torch.nn.ZeroPad3d",
                    "torch.nn.ConstantPad1d",
                    "torch.nn.ConstantPad2d",
                    "torch.nn.ConstantPad3d",
                    "torch.nn.ReflectionPad1d",
                    "torch.nn.ReflectionPad2d",
                    "torch.nn.ReflectionPad3d",
                    "torch.nn.ReplicationPad1d",
                    "torch.nn.ReplicationPad2d",
                    "torch.nn.ReplicationPad3d",
                    "torch.nn.CircularPad1d",
                    "torch.nn.CircularPad2d",
                    "torch.nn.CircularPad3d",
                ),
                _pad_module,
            ),
        ),
        lower={"tir": tir_rule("slice_grad"), "c": "emit:_slice_grad"},
        doc="zero padding along one axis: x placed into zeros at [start, stop)",
        moves_batch=sliced_batch_axis,
    ),
    OpDef(
        Op.SLICE_GRAD,
        {"dim": 0, "start": 0, "stop": 0},
        reference=_slice_grad,
        lower={"tir": tir_rule("slice_grad"), "c": "emit:_slice_grad"},
        doc="dy placed into zeros of the sliced tensor's shape",
        moves_batch=sliced_batch_axis,
    ),
    OpDef(
        Op.ADD_PARAM,
        {"view": (), "rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=_add_param_vjp,
        reference=_add_param,
        lower={"tir": tir_rule("add_param"), "c": "emit:_add_param"},
        doc="activation + a parameter broadcast over it: [1, ...] over the batch (a positional "
        "embedding), or seen as `view`, varying along one run of axes (a bias per channel)",
        data_parallel=True,
    ),
    OpDef(
        Op.EXPAND_PARAM,
        {"over_batch": True},
        types=elementwise_types,
        vjp=_expand_param_vjp,
        reference=_expand_param,
        frontend=(
            Pattern("method", ("expand", "expand_as"), _expand),
            Pattern("function", ("mexc.ops.tensor.lifted_over_batch",), _lifted),
        ),
        lower={"tir": tir_rule("expand_param"), "c": "emit:_expand_param"},
        doc="a [1, ...] parameter repeated over the batch (a class token); exponent kept; "
        "over_batch=False: one copy with a leading axis of 1 (a weight computed each step)",
        batch_results=_repeated_over_batch,
    ),
    OpDef(
        Op.ADD_PARAM_GRAD,
        {"view": ()},
        reference=_add_param_grad,
        lower={"tir": tir_rule("add_param_grad"), "c": "emit:_add_param_grad"},
        doc="the parameter's gradient: dy summed over the axes it is broadcast along, int32",
        data_parallel=True,
        batch_partial=(0,),
    ),
    OpDef(
        Op.CONCAT,
        {"dim": 1, "rid": -1},
        types=elementwise_types,
        keeps_axes=off_dim,
        vjp=_concat_vjp,
        reference=_concat,
        frontend=(
            Pattern(
                "function", ("torch.cat", "torch.concat", "torch.concatenate"), _concat_tensors
            ),
            Pattern("function", ("torch.stack",), _stack),
            Pattern("function", ("torch.roll",), _roll),
            Pattern("method", ("roll",), _roll),
        ),
        lower={"tir": tir_rule("concat"), "c": "emit:_concat"},
        doc="concatenation along a feature axis, aligned to a common exponent, one compaction",
        data_parallel=keeps_batch_dim,
    ),
    OpDef(
        Op.MUL,
        {"view": (), "rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=_mul_vjp,
        reference=_mul_ref,
        frontend=(
            Pattern("function", ("operator.mul", "torch.mul", "operator.imul"), _mul),
            Pattern("method", ("mul",), _mul),
            Pattern("function", ("operator.pow", "torch.pow", "torch.square"), _pow),
            Pattern("method", ("pow", "square"), _pow),
        ),
        lower={"tir": tir_rule("mul"), "c": "emit:_mul"},
        doc="x * g, g an activation or parameter broadcast along x's axes (or a constant: scale)",
        data_parallel=True,
    ),
    OpDef(
        Op.DIV,
        {"rid": -1},
        types=elementwise_types,
        keeps_axes=True,
        vjp=_div_vjp,
        reference=_div_ref,
        lower={"tir": tir_rule("div"), "c": "emit:_div"},
        doc="a / b of two activations of one shape: the mantissas' quotient to 2^-15 "
        "(b's 0 as half a unit), compacted (docs/layers.md)",
        data_parallel=True,
    ),
    OpDef(
        Op.MUL_GRAD,
        {"param": False, "view": (), "rid": -1},
        reference=_mul_grad_ref,
        lower={"tir": tir_rule("mul_grad"), "c": "emit:_mul_grad"},
        doc="dg of x * g: dy * x summed over g's broadcast axes (int32 for a parameter)",
        data_parallel=True,
        batch_partial=param_grad_share,
    ),
    OpDef(
        Op.MEAN_TOKENS,
        {"rid": -1},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.MEAN_TOKENS_GRAD, no_saved),
        reference=_mean_tokens,
        frontend=(
            Pattern("function", ("torch.mean",), _mean),
            Pattern("method", ("mean",), _mean),
            Pattern("function", ("torch.sum",), _sum),
            Pattern("method", ("sum",), _sum),
        ),
        lower={"tir": tir_rule("mean_tokens"), "c": "emit:_mean_tokens"},
        doc="mean over the token axis: [B, T, D] -> [B, D]",
        data_parallel=True,
    ),
    OpDef(
        Op.MEAN_TOKENS_GRAD,
        {"rid": -1},
        reference=_mean_tokens_grad,
        lower={"tir": tir_rule("mean_tokens_grad"), "c": "emit:_mean_tokens_grad"},
        doc="dy spread evenly over the tokens",
        data_parallel=True,
    ),
)
