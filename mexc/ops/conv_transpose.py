"""nn.ConvTranspose2d / ConvTranspose1d and F.conv_transpose2d / conv_transpose1d as the
convolution's dx product.

A transposed convolution of x with weight W (C_in, C_out / groups, kh, kw), stride s, padding
p is the gradient, with respect to its input, of the convolution with the same W, s and p that
maps C_out channels to C_in: the product CONV2D_GRAD_INPUT already computes in every backward
pass, on every backend, with x in the place of dy. The layer is that op in the forward graph,
its output shape the traced one (output_padding < s adds rows and columns that no input
reaches in that convolution: zero before the bias), and its bias an ADD_PARAM per channel. Its
gradients are the convolution's other two products (ops.dense._conv_transpose_vjp): dx the
forward convolution of dy with W, dW the convolution's weight gradient with dy as its input
and x as its output gradient. No new kernel: the same int8 products, compactions and rounding
sites the convolution's backward pass has, so the numerics are those of docs/numerics.md's
convolution. A 1-D layer is the 2-D one over (N, C, 1, L) with a (1, k) kernel.
"""

from __future__ import annotations

from typing import Any

from mexc.errors import UnsupportedOpError
from mexc.ir import Op, Value
from mexc.ops.common import as_rows, pair, single, static_value
from mexc.ops.tensor import reshaped


def _pair(c: Any, n: Any, v: Any, what: str, one_d: bool, height: int) -> tuple[int, int]:
    """A stride, padding or dilation as (height, width); a 1-D layer's is (`height`, its one)."""
    v = static_value(v)
    if isinstance(v, str):
        raise UnsupportedOpError(c.describe(n, f"gives {what} {v!r}; give integers"))
    return (height, single(v, what)) if one_d else pair(v)


def _transposed(
    c: Any,
    n: Any,
    x: Any,
    weight: Value,
    bias: Value | None,
    geometry: dict[str, Any],
    one_d: bool,
) -> Value:
    """The transposed convolution of x (the traced node) with `weight` (a PARAM held
    (C_in, C_out / groups, kh, kw)), n's result. `geometry`: stride, padding, dilation, groups
    as the layer gives them."""
    stride = _pair(c, n, geometry["stride"], "stride", one_d, 1)
    padding = _pair(c, n, geometry["padding"], "padding", one_d, 0)
    dilation = _pair(c, n, geometry["dilation"], "dilation", one_d, 1)
    if dilation != (1, 1):
        raise UnsupportedOpError(
            c.describe(
                n, f"is a transposed convolution with dilation {list(dilation)}; mexc takes 1"
            )
        )
    v = c.arg(x)
    if c.batch_axis(v) not in (0, None):
        raise UnsupportedOpError(
            c.describe(n, "is a transposed convolution whose batch is not axis 0")
        )
    out = tuple(c.shape(n))
    xs = tuple(c.shape(x))
    if len(xs) != (3 if one_d else 4):
        shape = "(N, C, L)" if one_d else "(N, C, H, W)"
        raise UnsupportedOpError(
            c.describe(n, f"is a transposed convolution of an unbatched input; give it {shape}")
        )
    if one_d:  # (N, C, L) as (N, C, 1, L)
        xs = (xs[0], xs[1], 1, xs[2])
        v = reshaped(c, v, xs)
    result = (out[0], out[1], 1, out[2]) if one_d else out
    conv = {"stride": stride, "padding": padding, "groups": int(geometry["groups"])}
    y = c.emit_as(Op.CONV2D_GRAD_INPUT, [v, weight], result, **conv)
    if bias is not None:
        y = c.emit_as(Op.ADD_PARAM, [y, bias], result, view=(1, result[1], 1, 1))
    return c.emit(Op.RESHAPE, [y], n, shape=out) if one_d else y


def conv_transpose_module(c: Any, n: Any, m: Any) -> Value:
    """nn.ConvTranspose2d / nn.ConvTranspose1d."""
    one_d = m.weight.dim() == 3
    if m.padding_mode != "zeros":
        raise UnsupportedOpError(
            c.describe(n, f"is a transposed convolution with padding_mode {m.padding_mode!r}")
        )
    if one_d:  # held (C_in, C_out / groups, 1, k), the 2-D layer's kernel
        arranged = as_rows(m.weight)
        weight = c.param(
            f"{n.target}.weight", m.weight.unsqueeze(2), "weight", arranged=arranged, tie=m.weight
        )
    else:
        weight = c.param(f"{n.target}.weight", m.weight, "weight")
    bias = c.param(f"{n.target}.bias", m.bias, "bias") if m.bias is not None else None
    geometry = {"stride": m.stride, "padding": m.padding, "dilation": m.dilation}
    return _transposed(c, n, n.args[0], weight, bias, {**geometry, "groups": m.groups}, one_d)


def conv_transpose_function(c: Any, n: Any) -> Value:
    """F.conv_transpose2d / F.conv_transpose1d with a parameter as the weight (and bias)."""
    names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    w, b = args["weight"], args.get("bias")
    if not c.is_param(w):
        raise UnsupportedOpError(c.describe(n, "needs its weight to be a module parameter"))
    tensor = c.fetch(w)
    one_d = tensor.dim() == 3
    if one_d:  # held (C_in, C_out / groups, 1, k), as the module's
        weight = c.param(
            str(w.target), tensor.unsqueeze(2), "weight", arranged=as_rows(tensor), tie=tensor
        )
    else:
        weight = c.get_param(w, "weight")
    bias = c.get_param(b, "bias") if b is not None else None
    geometry = {
        "stride": args.get("stride", 1),
        "padding": args.get("padding", 0),
        "dilation": args.get("dilation", 1),
        "groups": static_value(args.get("groups", 1)),
    }
    return _transposed(c, n, args["input"], weight, bias, geometry, one_d)
