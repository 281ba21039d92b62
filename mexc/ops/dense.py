"""Products: conv2d and linear, their compactions and their gradients."""

from __future__ import annotations

from typing import Any, NamedTuple

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.kernels._common import compact_mx, site_key
from mexc.mx import MX, Acc
from mexc.ops.common import (
    Grads,
    as_rows,
    before_last,
    elementwise_types,
    mx_like,
    pair,
    pass_through,
    rows,
    shape,
    single,
    static_int,
    tid,
)
from mexc.ops.conv3d import conv3d_function, conv3d_module
from mexc.ops.conv_transpose import conv_transpose_function, conv_transpose_module
from mexc.ops.dilated import dilated_conv, dilated_size
from mexc.ops.gather import is_gathered
from mexc.ops.patches import fold, unfold
from mexc.ops.recurrent import recurrent_cell, recurrent_module
from mexc.ops.registry import OpDef, Pattern, define, op_def
from mexc.ops.tensor import (
    as_result,
    as_rows_2d,
    every_nth,
    padded,
    plus_folded_bias,
    reshaped,
)
from mexc.types import acc, mx

_CONV: dict[str, Any] = {"stride": (1, 1), "padding": (0, 0), "groups": 1, "has_bias": False}
CAP: dict[str, Any] = {"shift_cap": None, "pre_shift": 0}


# ----------------------------------------------------------------------------- types


def product_types(r: Any, n: Node) -> None:
    """A product yields an int32 accumulator, compacted by an explicit COMPACT node."""
    prod = r.copy(n, (acc(*n.type.shape),))
    a = op_def(Op.COMPACT).make(bits=r.ctx.bits, rid=r.rid())
    compact = r.b.add(Op.COMPACT, [prod.out], mx_like(n.type), a, n.loc)
    r.env[n.out] = compact.out


# ----------------------------------------------------------------------------- VJPs


def _geometry_of(n: Node) -> dict[str, Any]:
    """The stride, padding and groups of convolution node n, for the products of its VJP."""
    return {"stride": n.attrs.stride, "padding": n.attrs.padding, "groups": n.attrs.groups}


def _conv_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, wt = n.inputs[0], n.inputs[1]
    conv = _geometry_of(n)
    dw = w.emit(Op.CONV2D_GRAD_WEIGHT, [dy, x], acc(*w.type(wt).shape), n.loc, **conv)
    grads: Grads = [None, w.weight_grad(wt, dw.out, n)]  # a standardized weight's goes on
    if w.needs[x]:
        grads[0] = w.emit(Op.CONV2D_GRAD_INPUT, [dy, wt], mx(*w.type(x).shape), n.loc, **conv).out
    if n.attrs.has_bias:
        db = w.emit(Op.BIAS_GRAD, [dy], acc(*w.type(n.inputs[2]).shape), n.loc, axes=(0, 2, 3))
        w.set_param_grad(n.inputs[2], db.out, n)
        grads.append(None)
    return grads


def _conv_transpose_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """A transposed convolution (CONV2D_GRAD_INPUT in the forward graph, ops.conv_transpose):
    dW is the convolution's weight gradient with dy as its input and x as its output
    gradient, dx the convolution of dy with W."""
    dy = dys[0]
    assert dy is not None
    x, wt = n.inputs[0], n.inputs[1]
    conv = _geometry_of(n)
    dw = w.emit(Op.CONV2D_GRAD_WEIGHT, [x, dy], acc(*w.type(wt).shape), n.loc, **conv)
    w.set_param_grad(wt, dw.out, n)
    if not w.needs[x]:
        return [None, None]
    bits = int(w.g.attr("bits", 8))
    dx = w.emit(Op.CONV2D_COMPACT, [dy, wt], mx(*w.type(x).shape), n.loc, bits=bits, **conv)
    return [dx.out, None]


def _linear_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    x, wt = n.inputs[0], n.inputs[1]
    dw = w.emit(Op.LINEAR_GRAD_WEIGHT, [dy, x], acc(*w.type(wt).shape), n.loc)
    w.set_param_grad(wt, dw.out, n)
    grads: Grads = [None, None]
    if w.needs[x]:
        grads[0] = w.emit(Op.LINEAR_GRAD_INPUT, [dy, wt], mx(*w.type(x).shape), n.loc).out
    if n.attrs.has_bias:
        axes = tuple(range(len(w.type(dy).shape) - 1))  # tokens too for [B, T, D] input
        db = w.emit(Op.BIAS_GRAD, [dy], acc(*w.type(n.inputs[2]).shape), n.loc, axes=axes)
        w.set_param_grad(n.inputs[2], db.out, n)
        grads.append(None)
    return grads


# ----------------------------------------------------------------------------- reference


def _conv(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    bias = a[2] if at.has_bias else None
    return (K.conv2d_forward(a[0], a[1], bias, at.stride, at.padding, at.groups, env.ctx, tid(n)),)


def _conv_wide(n: Node, a: list[Any], env: Any) -> Acc:
    at = n.attrs
    bias = a[2] if at.has_bias else None
    return K.conv2d_accumulate(a[0], a[1], bias, at.stride, at.padding, at.groups, env.ctx, tid(n))


def _linear(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    bias = a[2] if n.attrs.has_bias else None
    y = K.linear_forward(rows(a[0]), a[1], bias, env.ctx, tid(n))
    return (MX(y.m.reshape(n.type.shape), y.e),)


def _linear_wide(n: Node, a: list[Any], env: Any) -> Acc:
    bias = a[2] if n.attrs.has_bias else None
    out = K.linear_accumulate(rows(a[0]), a[1], bias, env.ctx, tid(n))
    return Acc(out.a.reshape(n.type.shape), out.e)


def _conv_grad_input(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.conv2d_backward_input(
            a[0], a[1], shape(n), at.stride, at.padding, at.groups, env.ctx, tid(n)
        ),
    )


def _conv_grad_weight(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.conv2d_backward_weight(
            a[0], a[1], shape(n), at.stride, at.padding, at.groups, env.ctx, tid(n)
        ),
    )


def _linear_grad_input(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    dx = K.linear_backward_input(rows(a[0]), a[1], env.ctx, tid(n))
    return (MX(dx.m.reshape(n.type.shape), dx.e),)


def _linear_grad_weight(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.linear_backward_weight(rows(a[0]), rows(a[1]), env.ctx, tid(n)),)


def _compact(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    """An accumulator no product fused (a computed weight's gradient), per tensor, site 0."""
    acc: Acc = a[0]
    return (compact_mx(acc.a, acc.e, env.ctx, site_key(env.ctx, tid(n), 0)),)


def _bias_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.bias_backward(a[0], tuple(n.attrs.axes)),)


# ----------------------------------------------------------------------------- reduction widths


def _conv_k(n: Node, t: Any) -> int:
    w = t(1).shape
    return int(w[1] * w[2] * w[3] + (1 if n.attrs.has_bias else 0))


def _linear_k(n: Node, t: Any) -> int:
    return int(t(1).shape[1] + (1 if n.attrs.has_bias else 0))


def _conv_grad_input_k(n: Node, t: Any) -> int:
    w = t(1).shape  # inputs: dy, w
    return int((w[0] // n.attrs.groups) * w[2] * w[3])


def _conv_grad_weight_k(n: Node, t: Any) -> int:
    dy = t(0).shape  # inputs: dy, x
    return int(dy[0] * dy[2] * dy[3])


def _linear_grad_input_k(n: Node, t: Any) -> int:
    return int(t(1).shape[0])  # inputs: dy, w[out, in]


def _linear_grad_weight_k(n: Node, t: Any) -> int:
    out = 1
    for d in t(0).shape[:-1]:  # inputs: dy[..., out], x[..., in]
        out *= d
    return out


# ----------------------------------------------------------------------------- frontend


def _conv_input(
    c: Any, n: Any, m: Any, xv: Value, shape: tuple[int, ...]
) -> tuple[Value, tuple[int, ...], tuple[int, int]]:
    """The input (xv, of `shape`: (N, C, H, W), a Conv1d's as (N, C, 1, L)) of a convolution
    module m, its shape, and the zero padding its op applies: padding="same" / "valid" as
    numbers, and the padding modes reflect, replicate and circular (or an uneven "same") as
    padding ops before it (ops.tensor.padded, with torch's own pad amounts, last axis first)."""
    mode = "constant" if m.padding_mode == "zeros" else str(m.padding_mode)
    if m.padding == "valid":
        return xv, shape, (0, 0)
    if m.padding != "same" and mode == "constant":
        given = tuple(static_int(p) for p in m.padding)  # (p,) for Conv1d, (ph, pw)
        return xv, shape, (0, given[0]) if len(given) == 1 else (given[0], given[1])
    pads = [int(p) for p in m._reversed_padding_repeated_twice]
    if mode == "constant" and pads[0::2] == pads[1::2]:
        return xv, shape, (pads[2], pads[0]) if len(pads) == 4 else (0, pads[0])
    both = pads + [0, 0]  # left, right[, top, bottom]
    grown = (*shape[:2], shape[2] + both[2] + both[3], shape[3] + both[0] + both[1])
    return padded(c, n, xv, shape, pads, mode), grown, (0, 0)


class _Geometry(NamedTuple):
    """A convolution's input (N, C, H, W) and its op's attributes (a Conv1d's over (N, C, 1,
    L)); kernel (kh, kw) and out channels O are the weight's."""

    shape: tuple[int, ...]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    kernel: tuple[int, int]
    out: int


def _conv_op(
    c: Any,
    n: Any,
    x: Value,
    weight: Value,
    bias: Value | None,
    g: _Geometry,
    result: tuple[int, ...],
) -> Value:
    """A CONV2D of x; with dilation, plain convolutions over the input's phases
    (mexc.ops.dilated), and a stride above 1 taken from the stride-1 result (every_nth)."""
    ins = [x, weight] + ([bias] if bias is not None else [])
    at = {"groups": g.groups, "has_bias": bias is not None}
    if g.dilation == (1, 1):
        return c.emit_as(Op.CONV2D, ins, result, stride=g.stride, padding=g.padding, **at)

    def phase(v: Value, out: tuple[int, ...]) -> Value:
        return c.emit_as(Op.CONV2D, [v, *ins[1:]], out, stride=(1, 1), padding=(0, 0), **at)

    y = dilated_conv(c, n, x, g.shape, g.kernel, g.padding, g.dilation, g.out, phase)
    full = dilated_size(g.shape, g.kernel, g.padding, g.dilation)
    shape: tuple[int, ...] = (g.shape[0], g.out, *full)
    for axis, s in ((2, g.stride[0]), (3, g.stride[1])):
        if s > 1:  # strided after the fact
            y, shape = every_nth(c, y, shape, axis, s)
    return y if shape == result else reshaped(c, y, result)


def _conv_module(c: Any, n: Any, m: Any) -> Value:
    x, shape, padding = _conv_input(c, n, m, c.arg(n.args[0]), tuple(c.shape(n.args[0])))
    weight = c.param(f"{n.target}.weight", m.weight, "weight")
    bias = c.param(f"{n.target}.bias", m.bias, "bias") if m.bias is not None else None
    kernel, out = (int(m.weight.shape[2]), int(m.weight.shape[3])), int(m.weight.shape[0])
    g = _Geometry(shape, pair(m.stride), padding, pair(m.dilation), m.groups, kernel, out)
    return _conv_op(c, n, x, weight, bias, g, tuple(c.shape(n)))


def _conv3d_module(c: Any, n: Any, m: Any) -> Value:
    """nn.Conv3d: conv2d over the frames (mexc.ops.conv3d)."""
    return conv3d_module(c, n, m, _frames_conv(c, n))


def _conv3d_function(c: Any, n: Any) -> Value:
    return conv3d_function(c, n, _frames_conv(c, n))


def _frames_conv(c: Any, n: Any) -> Any:
    """mexc.ops.conv3d's conv2d: a CONV2D with the weight's (kt O, C, kh, kw) kernel."""

    def conv2d(
        x: Value,
        weight: Value,
        shape: tuple[int, ...],
        kernel: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        result: tuple[int, ...],
    ) -> Value:
        g = _Geometry(shape, stride, padding, (1, 1), 1, kernel, result[1])
        return _conv_op(c, n, x, weight, None, g, result)

    return conv2d


def _conv_function(c: Any, n: Any) -> Value:
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    w, bias = args["weight"], args.get("bias")
    weight = c.computed_weight(w)  # a parameter, or one standardized each step
    kernel = c.shape(w)
    dilation = pair(args.get("dilation", 1))
    g = _Geometry(
        tuple(c.shape(args["input"])),
        pair(args.get("stride", 1)),
        _function_padding(c, n, args.get("padding", 0), kernel, dilation),
        dilation,
        int(args.get("groups", 1)),
        (int(kernel[2]), int(kernel[3])),
        int(kernel[0]),
    )
    b = c.get_param(bias, "bias") if bias is not None else None
    return _conv_op(c, n, c.arg(args["input"]), weight, b, g, tuple(c.shape(n)))


def _function_padding(
    c: Any, n: Any, padding: Any, kernel: tuple[int, ...], dilation: tuple[int, int]
) -> tuple[int, int]:
    """F.conv2d's padding: numbers, "valid" (none) or "same" (torch allows it at stride 1: the
    total d (k - 1) per axis, split evenly where it is even)."""
    if padding == "valid":
        return (0, 0)
    if padding != "same":
        return pair(padding)
    totals = [d * (int(k) - 1) for d, k in zip(dilation, kernel[2:])]
    if any(t % 2 for t in totals):
        raise UnsupportedOpError(
            c.describe(
                n,
                "pads 'same' unevenly (an even kernel: torch pads one more on the right and "
                "bottom); give the padding as numbers with an F.pad before the convolution",
            )
        )
    return (totals[0] // 2, totals[1] // 2)


def _conv1d(
    c: Any,
    n: Any,
    x: Any,
    weight: tuple[Value, Any],
    bias: Value | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    module: Any = None,
) -> Value:
    """Conv1d as Conv2d with a (1, k) kernel over (N, C, 1, L); its weight (the PARAM and the
    torch tensor) is held (O, C/g, 1, k). A module's padding="same" / "valid" and padding modes
    as Conv2d's (_conv_input)."""
    if len(c.shape(x)) != 3:
        raise UnsupportedOpError(c.describe(n, "convolves an unbatched input; give it (N, C, L)"))
    b, o, out = c.shape(n)
    n_, ch, length = c.shape(x)
    rows = as_rows_2d(c, x)
    shape: tuple[int, ...] = (n_, ch, 1, length)
    if module is not None:
        rows, shape, pad2d = _conv_input(c, n, module, rows, shape)
    else:
        pad2d = (0, single(padding, "padding"))
    geometry = _Geometry(
        shape,
        (1, single(stride, "stride")),
        pad2d,
        (1, single(dilation, "dilation")),
        int(groups),
        (1, int(weight[1].shape[-1])),
        o,
    )
    y = _conv_op(c, n, rows, weight[0], bias, geometry, (b, o, 1, out))
    return as_result(c, n, y)


def _conv1d_module(c: Any, n: Any, m: Any) -> Value:
    weight = c.param(
        f"{n.target}.weight",
        m.weight.unsqueeze(2),
        "weight",
        arranged=as_rows(m.weight),
        tie=m.weight,
    )
    bias = c.param(f"{n.target}.bias", m.bias, "bias") if m.bias is not None else None
    return _conv1d(
        c, n, n.args[0], (weight, m.weight), bias, m.stride, m.padding, m.dilation, m.groups, m
    )


def _conv1d_function(c: Any, n: Any) -> Value:
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    w = args["weight"]
    if not c.is_param(w):
        raise UnsupportedOpError(c.describe(n, "needs its weight to be a module parameter"))
    tensor = c.fetch(w)
    weight = c.param(
        str(w.target), tensor.unsqueeze(2), "weight", arranged=as_rows(tensor), tie=tensor
    )
    b = args.get("bias")
    bias = c.get_param(b, "bias") if b is not None else None
    stride, padding = args.get("stride", 1), args.get("padding", 0)
    return _conv1d(
        c,
        n,
        args["input"],
        (weight, c.fetch(w)),
        bias,
        stride,
        padding,
        args.get("dilation", 1),
        int(args.get("groups", 1)),
    )


def linear(c: Any, x: Value, weight: Value, bias: Value | None, result: tuple[int, ...]) -> Value:
    """x @ weight^T (+ bias) of shape `result`, a step of a decomposition (MultiheadAttention's
    projections, a contraction with a parameter)."""
    ins = [x, weight] + ([bias] if bias is not None else [])
    return c.emit_as(Op.LINEAR, ins, result, has_bias=bias is not None)


def _linear_module(c: Any, n: Any, m: Any) -> Value:
    ins = [c.arg(n.args[0]), c.param(f"{n.target}.weight", m.weight, "weight")]
    if m.bias is not None:
        ins.append(c.param(f"{n.target}.bias", m.bias, "bias"))
    return c.emit(Op.LINEAR, ins, n, has_bias=m.bias is not None)


def _linear_function(c: Any, n: Any) -> Value:
    """F.linear(x, weight, bias); a bias made from parameters (BEiT's torch.cat((q_bias,
    k_bias, v_bias))) is added after the layer."""
    args = dict(zip(("input", "weight", "bias"), n.args)) | dict(n.kwargs)
    x, w, bias = args["input"], args["weight"], args.get("bias")
    ins = [c.arg(x), c.get_param(w, "weight")]
    if bias is not None and is_gathered(c, bias):
        y = c.emit(Op.LINEAR, ins, n, has_bias=False)
        return plus_folded_bias(c, n, y, bias, tuple(c.shape(n)))
    if bias is not None:
        ins.append(c.get_param(bias, "bias"))
    return c.emit(Op.LINEAR, ins, n, has_bias=bias is not None)


def _recurrent(c: Any, n: Any, m: Any) -> tuple[Value, Any]:
    """nn.LSTM / GRU / RNN unrolled (mexc.ops.recurrent) with this module's `linear`."""
    return recurrent_module(c, n, m, linear)


def _cell(c: Any, n: Any, m: Any) -> Value | tuple[Value, Value]:
    """nn.LSTMCell / GRUCell / RNNCell, one step (mexc.ops.recurrent) with this `linear`."""
    return recurrent_cell(c, n, m, linear)


def _tir(name: str) -> str:
    return f"step_plan:PlanRules.{name}"


define(
    OpDef(
        Op.CONV2D,
        {**_CONV, **CAP},
        types=product_types,
        vjp=_conv_vjp,
        frontend=(
            Pattern("module", ("torch.nn.Conv2d",), _conv_module),
            Pattern("module", ("torch.nn.Conv3d",), _conv3d_module),
            Pattern("module", ("torch.nn.LSTM", "torch.nn.GRU", "torch.nn.RNN"), _recurrent),
            Pattern("module", ("torch.nn.LSTMCell", "torch.nn.GRUCell", "torch.nn.RNNCell"), _cell),
            Pattern("function", ("torch.conv3d", "torch.nn.functional.conv3d"), _conv3d_function),
            Pattern("function", ("torch.nn.functional.conv2d",), _conv_function),
            Pattern("module", ("torch.nn.Conv1d",), _conv1d_module),
            Pattern("module", ("torch.nn.Unfold",), unfold),
            Pattern("function", ("torch.nn.functional.unfold",), unfold),
            Pattern("function", ("torch.nn.functional.conv1d",), _conv1d_function),
        ),
        product=True,
        reduction=_conv_k,
        fused=Op.CONV2D_COMPACT,
        doc="2-D convolution (grouped and depthwise included), before fuse-products",
    ),
    OpDef(
        Op.LINEAR,
        {"has_bias": False, **CAP},
        types=product_types,
        keeps_axes=before_last,
        vjp=_linear_vjp,
        frontend=(
            Pattern("module", ("torch.nn.Linear",), _linear_module),
            Pattern("function", ("torch.nn.functional.linear",), _linear_function),
        ),
        product=True,
        channels_last=True,
        reduction=_linear_k,
        fused=Op.LINEAR_COMPACT,
        doc="fully connected layer over the last axis, before fuse-products",
    ),
    OpDef(
        Op.COMPACT,
        {"bits": 8, "rid": -1},
        vjp=pass_through,
        reference=_compact,
        lower={"tir": "step_plan:PlanRules.compact_alone", "c": "emit:_compact"},
        compaction=True,
        doc="int32 accumulator -> MX (shift with rounding, per tensor, site 0); fused into its "
        "product, alone where none computed it (a computed weight's gradient)",
    ),
    OpDef(
        Op.CONV2D_COMPACT,
        {**_CONV, **CAP, "bits": 8, "rid": -1},
        vjp=_conv_vjp,
        reference=_conv,
        reference_wide=_conv_wide,
        lower={
            "tir": _tir("conv"),
            "tir_wide": _tir("conv_wide"),
            "c": "emit:_conv",
            "gemm": "products_build:conv_forms",
        },
        product=True,
        reduction=_conv_k,
        doc="convolution fused with its compaction",
        data_parallel=True,
    ),
    OpDef(
        Op.LINEAR_COMPACT,
        {"has_bias": False, **CAP, "bits": 8, "rid": -1},
        vjp=_linear_vjp,
        reference=_linear,
        reference_wide=_linear_wide,
        lower={
            "tir": _tir("linear"),
            "tir_wide": _tir("linear_wide"),
            "c": "emit:_linear",
            "gemm": "products_build:linear_forms",
        },
        product=True,
        channels_last=True,
        reduction=_linear_k,
        doc="linear layer fused with its compaction",
        data_parallel=True,
    ),
    OpDef(
        Op.CONV2D_GRAD_INPUT,
        {**_CONV, **CAP, "rid": -1},
        types=elementwise_types,
        vjp=_conv_transpose_vjp,
        frontend=(
            Pattern("module", ("torch.nn.ConvTranspose2d",), conv_transpose_module),
            Pattern("module", ("torch.nn.ConvTranspose1d",), conv_transpose_module),
            Pattern("function", ("torch.nn.functional.conv_transpose2d",), conv_transpose_function),
            Pattern("function", ("torch.nn.functional.conv_transpose1d",), conv_transpose_function),
            Pattern("module", ("torch.nn.Fold",), fold),
            Pattern("function", ("torch.nn.functional.fold",), fold),
        ),
        reference=_conv_grad_input,
        lower={
            "tir": _tir("conv_grad_input"),
            "c": "emit:_conv_grad_input",
            "gemm": "products_build:conv_grad_input_forms",
        },
        product=True,
        reduction=_conv_grad_input_k,
        doc="dx of a convolution, compacted; in the forward graph a transposed convolution",
        data_parallel=True,
    ),
    OpDef(
        Op.CONV2D_GRAD_WEIGHT,
        {**_CONV, **CAP, "rid": -1},
        reference=_conv_grad_weight,
        lower={
            "tir": _tir("conv_grad_weight"),
            "c": "emit:_conv_grad_weight",
            "gemm": "products_build:conv_grad_weight_forms",
        },
        product=True,
        reduction=_conv_grad_weight_k,
        doc="dw of a convolution: an int32 accumulator for the update",
        data_parallel=True,
        batch_partial=(0,),
    ),
    OpDef(
        Op.LINEAR_GRAD_INPUT,
        {**CAP, "rid": -1},
        reference=_linear_grad_input,
        lower={
            "tir": _tir("linear_grad_input"),
            "c": "emit:_linear_grad_input",
            "gemm": "products_build:linear_grad_input_forms",
        },
        product=True,
        channels_last=True,
        reduction=_linear_grad_input_k,
        doc="dx of a linear layer, compacted",
        data_parallel=True,
    ),
    OpDef(
        Op.LINEAR_GRAD_WEIGHT,
        {**CAP, "rid": -1},
        reference=_linear_grad_weight,
        lower={
            "tir": _tir("linear_grad_weight"),
            "c": "emit:_linear_grad_weight",
            "gemm": "products_build:linear_grad_weight_forms",
        },
        product=True,
        reduction=_linear_grad_weight_k,
        doc="dw of a linear layer: an int32 accumulator for the update",
        data_parallel=True,
        batch_partial=(0,),
    ),
    OpDef(
        Op.BIAS_GRAD,
        {"axes": (0,)},
        reference=_bias_grad,
        lower={"tir": _tir("bias_grad"), "c": "emit:_bias_grad"},
        doc="db: the sum of dy over the batch (and spatial or token) axes, int32",
        data_parallel=True,
        batch_partial=(0,),
    ),
)
