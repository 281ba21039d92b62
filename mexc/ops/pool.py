"""Pooling: max, average, global and adaptive average pooling, nearest upsampling, and their
gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.ops.activation import elementwise_extreme
from mexc.ops.bilinear import linear_resample
from mexc.ops.common import (
    POOL_OPTIONS,
    Grads,
    elementwise_types,
    no_saved,
    pair,
    pointwise_vjp,
    pool_call_arguments,
    shape,
    single,
    static_int,
    static_value,
    tid,
    with_index_types,
)
from mexc.ops.registry import OpDef, Pattern, define
from mexc.ops.tensor import (
    as_result,
    as_rows_2d,
    concatenated,
    mean_over,
    reshaped,
    scaled,
    sliced,
    transposed,
)
from mexc.types import mx

_POOL: dict[str, Any] = {"kernel": (2, 2), "stride": (2, 2), "padding": (0, 0)}
# max pooling with torch's ceil_mode: `extra` pads the bottom and right once more, so that the
# last windows reach past the input (the padding never wins a max)
_MAXPOOL: dict[str, Any] = {**_POOL, "extra": (0, 0)}


def _relu_before_pool(w: Any, pool: Node) -> Node | None:
    """The ReLU feeding a non-overlapping, unpadded max pool as its only consumer, if any."""
    a = pool.attrs
    src = w.g.node(pool.inputs[0].node)
    overlapping = a.stride[0] < a.kernel[0] or a.stride[1] < a.kernel[1]
    padded = tuple(a.padding) != (0, 0) or tuple(a.extra) != (0, 0)
    if src.op is not Op.RELU or overlapping or padded:
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
        extra=a.extra,
    )
    return [grad.out]


def _maxpool(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return tuple(K.maxpool2d_forward(a[0], at.kernel, at.stride, at.padding, at.extra))


def _avgpool(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (K.avgpool2d_forward(a[0], at.kernel, at.stride, at.padding, env.ctx, tid(n)),)


def _gap(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.global_avgpool_forward(a[0], env.ctx, tid(n)),)


def _maxpool_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.maxpool2d_backward(
            a[0], a[1], shape(n), at.kernel, at.stride, at.padding, env.ctx, tid(n), at.extra
        ),
    )


def _avgpool_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.avgpool2d_backward(a[0], shape(n), at.kernel, at.stride, at.padding, env.ctx, tid(n)),
    )


def _gap_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.global_avgpool_backward(a[0], shape(n), env.ctx, tid(n)),)


def _pool(c: Any, n: Any, op: Op, kernel: Any, stride: Any, padding: Any, opts: dict) -> Value:
    """A max or average pool of the traced call: the window geometry, and the output size of
    ceil_mode as extra bottom/right padding (read off the traced result's shape)."""
    _check_batched(c, n, n.args[0])
    k, p = pair(kernel), pair(padding)
    s = k if stride in (None, []) else pair(stride)
    if opts.get("dilation", 1) not in (1, (1, 1), [1, 1]):
        raise UnsupportedOpError(c.describe(n, "uses dilation; only dilation 1 is supported"))
    h, w = c.shape(n.args[0])[2:]
    oh, ow = c.shape(n)[2:]
    extra = tuple(
        max((o - 1) * st + kk - (size + 2 * pp), 0)
        for o, st, kk, size, pp in zip((oh, ow), s, k, (h, w), p)
    )
    _check_pool(c, n, op, opts)
    if op is Op.MAXPOOL2D:
        return c.emit(op, [c.arg(n.args[0])], n, kernel=k, stride=s, padding=p, extra=extra)
    shape = tuple(c.shape(n.args[0]))
    return _average(c, n, c.arg(n.args[0]), shape, (k, s, p, extra), opts, tuple(c.shape(n)))


def _check_pool(c: Any, n: Any, op: Op, opts: dict) -> None:
    """A max pool returns no indices."""
    if op is Op.MAXPOOL2D and opts.get("return_indices"):
        raise UnsupportedOpError(c.describe(n, "returns indices; use return_indices=False"))


def torch_divisors(
    size: tuple[int, int], geometry: tuple, include_pad: bool, out: tuple[int, int]
) -> np.ndarray:
    """The divisor of every output window of torch's avg_pool2d (its CPU kernel's formula):
    the window clipped to the padded input (never to ceil_mode's overhang), and to the input
    itself where the padding is not counted."""
    k, s, p, _ = geometry
    per_axis = []
    for axis in range(2):
        starts = np.arange(out[axis]) * s[axis] - p[axis]
        ends = np.minimum(starts + k[axis], size[axis] + p[axis])
        if include_pad:
            per_axis.append(ends - starts)
        else:
            per_axis.append(np.minimum(ends, size[axis]) - np.maximum(starts, 0))
    return np.outer(per_axis[0], per_axis[1])


def _average(
    c: Any, n: Any, v: Value, shape: tuple, geometry: tuple, opts: dict, out: tuple
) -> Value:
    """An average pool as torch computes it: the avgpool2d op (sum / kh kw, zero padding;
    ceil_mode's overhang as zeros padded below and right first), then, where torch divides
    some windows by fewer elements (count_include_pad=False at the borders, ceil_mode windows
    past the input) or by divisor_override, a multiplication by kh kw / divisor: a constant
    map (1, 1, OH, OW) the compiler never trains, or a scale when it is one number. The
    ratios of a 3 x 3 window are 1, 1.5 and 2.25, exact in int8 (at 2^-5)."""
    k, s, p, extra = geometry
    b, ch, h, w = shape
    for dim, more in ((2, extra[0]), (3, extra[1])):
        if more:
            size = list(shape)
            inner = size[dim]
            size[dim] += more
            shape = tuple(size)
            v = c.emit_as(Op.PAD, [v], shape, dim=dim, start=0, stop=inner)
    y = c.emit_as(Op.AVGPOOL2D, [v], out, kernel=k, stride=s, padding=p)
    override = opts.get("divisor_override")
    if override is not None:
        divisors = np.full(out[2:], float(override))
    else:
        include = bool(opts.get("count_include_pad", True))
        divisors = torch_divisors((h, w), geometry, include, out[2:]).astype(np.float64)
    ratio = (k[0] * k[1]) / divisors
    if np.all(ratio == 1.0):
        return y
    if np.all(ratio == ratio.flat[0]):
        return scaled(c, y, out, float(ratio.flat[0]))
    factor = c.constant(f"{n.name}.divisors", ratio.reshape(out[2:]), "scale")
    return c.emit_as(Op.MUL, [y, factor], out, view=(1, 1, *out[2:]))


def _pool_module(op: Op, build: Callable[..., Value] | None = None) -> Callable[..., Value]:
    """The converter of a pooling module: `build` (_pool, or _pool1d) of its geometry."""

    def convert(c: Any, n: Any, m: Any) -> Value:
        opts = {o: getattr(m, o) for o in POOL_OPTIONS if hasattr(m, o)}
        return (build or _pool)(c, n, op, m.kernel_size, m.stride, m.padding, opts)

    return convert


def _pool_function(op: Op, build: Callable[..., Value] | None = None) -> Callable[..., Value]:
    """The converter of F.max_pool2d / avg_pool2d (and their 1-D forms, `build` _pool1d)."""

    def convert(c: Any, n: Any) -> Value:
        kind = "max" if op is Op.MAXPOOL2D else "avg"
        kernel, stride, padding, opts = pool_call_arguments(n, kind)
        return (build or _pool)(c, n, op, kernel, stride, padding, opts)

    return convert


def _adaptive(c: Any, n: Any, x: Any, op: Op = Op.AVGPOOL2D) -> Value:
    """adaptive_avg_pool2d (op AVGPOOL2D) or adaptive_max_pool2d (MAXPOOL2D) where every
    window has one size: per axis, an output size that divides the input's is a pool of kernel
    = stride = in / out (an average pool to 1 x 1: the global pool), and a multiple of it is
    nearest upsampling (each output reads one input pixel)."""
    _check_batched(c, n, x)
    return _adaptive_steps(c, n, c.arg(x), tuple(c.shape(x)), tuple(c.shape(n)), op, True)


def _check_batched(c: Any, n: Any, x: Any) -> None:
    """A 2-D pool reads (N, C, H, W): torch reads a 3-D tensor as one unbatched image."""
    shape = list(c.shape(x))
    if len(shape) != 4:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"pools a tensor of shape {shape}; torch reads a 3-D one as a single unbatched "
                "(C, H, W) image, and mexc pools batches (N, C, H, W): x.unsqueeze(1) first",
            )
        )


def _adaptive_steps(
    c: Any, n: Any, v: Value, shape: tuple, out: tuple, op: Op, last_is_n: bool
) -> Value:
    """_adaptive on value v of (N, C, H, W) `shape` to `out`; the last op is n's result when
    `last_is_n`, else a step (a 1-D pool reshapes it)."""
    (h, w), (oh, ow) = shape[2:], out[2:]

    def emit(op: Op, x: Value, result: tuple, last: bool, **kw: Any) -> Value:
        if last and last_is_n:
            return c.emit(op, [x], n, **kw)
        return c.emit_as(op, [x], result, **kw)

    if op is Op.AVGPOOL2D and (oh, ow) == (1, 1):
        return emit(Op.GLOBAL_AVGPOOL, v, out, True)
    for axis, o in ((2, oh), (3, ow)):  # windows of several sizes: one pool per window
        if shape[axis] % o and o % shape[axis]:
            v, shape = _uneven_windows(c, v, shape, axis, o, op)
    (h, w) = shape[2:]
    if (h, w) == (oh, ow):
        return as_result(c, n, v) if last_is_n else v
    kernel, up = [1, 1], [1, 1]
    for axis, (size, o) in enumerate(((h, oh), (w, ow))):
        if size % o == 0:
            kernel[axis] = size // o
        else:
            up[axis] = o // size
    if kernel != [1, 1]:
        k = tuple(kernel)
        mid = (*shape[:2], h // kernel[0], w // kernel[1])
        v = emit(op, v, mid, up == [1, 1], kernel=k, stride=k, padding=(0, 0))
    if up == [1, 1]:
        return v  # output size = input size
    return emit(Op.UPSAMPLE_NEAREST, v, out, True, scale=tuple(up))


def _uneven_windows(
    c: Any, v: Value, shape: tuple, axis: int, o: int, op: Op
) -> tuple[Value, tuple]:
    """Adaptive pooling along `axis` to `o` where the windows differ in size (5 to 3: [0, 2),
    [1, 4), [3, 5)): torch's window [floor(i L / o), ceil((i + 1) L / o)) of each output i as a
    slice pooled whole (its own divisor), the results concatenated."""
    size = shape[axis]
    pieces = []
    for i in range(o):
        lo, hi = (i * size) // o, -((-(i + 1) * size) // o)
        one = (*shape[:axis], 1, *shape[axis + 1 :])
        k = (hi - lo, 1) if axis == 2 else (1, hi - lo)
        window = sliced(c, v, shape, axis, lo, hi)
        pieces.append(c.emit_as(op, [window], one, kernel=k, stride=k, padding=(0, 0)))
    out = (*shape[:axis], o, *shape[axis + 1 :])
    return concatenated(c, pieces, out, axis), out


def _adaptive_1d(c: Any, n: Any, x: Any, op: Op) -> Value:
    """AdaptiveAvgPool1d / AdaptiveMaxPool1d: the 2-D forms over (N, C, 1, L)."""
    b, ch, length = c.shape(x)
    out = (b, ch, 1, c.shape(n)[-1])
    v = _adaptive_steps(c, n, as_rows_2d(c, x), (b, ch, 1, length), out, op, False)
    return as_result(c, n, v)


def _pool1d(c: Any, n: Any, op: Op, kernel: Any, stride: Any, padding: Any, opts: dict) -> Value:
    """MaxPool1d / AvgPool1d: the 2-D pools with a (1, k) window over (N, C, 1, L)."""
    x = n.args[0]
    if len(c.shape(x)) != 3:
        raise UnsupportedOpError(c.describe(n, "pools an unbatched input; give it (N, C, L)"))
    k = single(kernel, "kernel")
    s = k if stride in (None, []) else single(stride, "stride")
    p = single(padding, "padding")
    if single(opts.get("dilation", 1), "dilation") != 1:
        raise UnsupportedOpError(c.describe(n, "uses dilation; only dilation 1 is supported"))
    b, ch, length = c.shape(x)
    out = c.shape(n)[-1]
    extra = (0, max((out - 1) * s + k - (length + 2 * p), 0))
    _check_pool(c, n, op, opts)
    rows = as_rows_2d(c, x)
    if op is Op.AVGPOOL2D:
        geometry = ((1, k), (1, s), (0, p), extra)
        y = _average(c, n, rows, (b, ch, 1, length), geometry, opts, (b, ch, 1, out))
        return as_result(c, n, y)
    y = c.emit_as(
        op, [rows], (b, ch, 1, out), kernel=(1, k), stride=(1, s), padding=(0, p), extra=extra
    )
    return as_result(c, n, y)


def _reduce_max(c: Any, n: Any, x: Any, dims: Any, keepdim: bool) -> Value:
    """The maximum over `dims` (not the batch axis) of traced x (_reduce_max_of)."""
    return _reduce_max_of(c, n, c.arg(x), tuple(c.shape(x)), dims, keepdim)


def reduced_max(c: Any, n: Any, v: Value, shape: tuple[int, ...], axis: int) -> Value:
    """The maximum of v (of `shape`, a step of a decomposition) over `axis`."""
    return _reduce_max_of(c, n, v, shape, axis, False)


def _reduce_min(c: Any, n: Any, x: Any, dims: Any, keepdim: bool) -> Value:
    """The minimum over `dims` of traced x: -max(-x), the negations a scale by -1 (exact but
    for a mantissa of -128, which the scale's compaction rounds)."""
    shape = tuple(c.shape(x))
    top = _reduce_max_of(c, n, scaled(c, c.arg(x), shape, -1.0), shape, dims, keepdim)
    return scaled(c, top, _reduced_shape(shape, dims, keepdim), -1.0)


def _reduced_shape(shape: tuple[int, ...], dims: Any, keepdim: bool) -> tuple[int, ...]:
    rank = len(shape)
    reduced = {static_int(d) % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    return tuple(
        1 if a in reduced else shape[a] for a in range(rank) if keepdim or a not in reduced
    )


def _reduce_max_of(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], dims: Any, keepdim: bool
) -> Value:
    """The maximum of v (of `shape`) over `dims` (not the batch axis) as a max pool: the
    reduced axes moved behind the others, v seen as (N, R, 1, K), one (1, K) window per row,
    then the result's shape. Its gradient goes to the first maximum in the row-major order of
    the reduced axes (torch.max(x, dim)'s index; amax shares it among ties)."""
    rank = len(shape)
    reduced = sorted(
        {static_int(d) % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    )
    batch = c.first_or_batch_axis(v)
    if batch in reduced:
        raise UnsupportedOpError(
            c.describe(n, "takes a maximum over the batch axis; reduce the other axes")
        )
    kept = [a for a in range(rank) if a != batch and a not in reduced]
    perm = (batch, *kept, *reduced)
    if perm != tuple(range(rank)):
        v = transposed(c, v, shape, perm)
    rows = int(np.prod([shape[a] for a in kept], dtype=np.int64))
    k = int(np.prod([shape[a] for a in reduced], dtype=np.int64))
    grid = (shape[batch], rows, 1, k)
    v = reshaped(c, v, grid)
    v = c.emit_as(
        Op.MAXPOOL2D, [v], (shape[batch], rows, 1, 1), kernel=(1, k), stride=(1, k), padding=(0, 0)
    )
    order = sorted([batch, *kept])  # the kept axes in their own order
    if order != [batch, *kept]:  # the batch was not the first of them: moved back
        mid = tuple(shape[a] for a in (batch, *kept))
        v = transposed(c, reshaped(c, v, mid), mid, tuple([batch, *kept].index(a) for a in order))
    return reshaped(c, v, _reduced_shape(shape, dims, keepdim))


def _extreme_call(largest: bool) -> Callable[[Any, Any], Any]:
    """The converter of torch.max / torch.min (x, dim[, keepdim]) and x.max(dim) / x.min(dim):
    (values, indices), of which mexc computes the values (the minimum as -max(-x)); of two
    tensors: torch.maximum / torch.minimum. Of every element: refused."""
    word, reduce = ("maximum", _reduce_max) if largest else ("minimum", _reduce_min)

    def convert(c: Any, n: Any) -> Any:
        args = dict(zip(("input", "dim", "keepdim"), n.args)) | dict(n.kwargs)
        dim = args.get("dim", args.get("other"))
        if dim is None:
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"takes the {word} of every element of the batch, which would mix its "
                    "samples; mexc takes one per sample: give a dim (the flattened sample's, "
                    "x.flatten(1).max(1)), or scale by a constant",
                )
            )
        if c.is_node(dim):
            return elementwise_extreme(c, n, args["input"], dim, largest)
        return (reduce(c, n, args["input"], dim, bool(args.get("keepdim", False))), None)

    return convert


def _extreme_over(largest: bool) -> Callable[[Any, Any], Value]:
    """The converter of torch.amax / torch.amin (x, dim[, keepdim]) and the methods."""
    word, reduce = ("maximum", _reduce_max) if largest else ("minimum", _reduce_min)

    def convert(c: Any, n: Any) -> Value:
        args = dict(zip(("input", "dim", "keepdim"), n.args)) | dict(n.kwargs)
        if args.get("dim") in (None, (), []):
            raise UnsupportedOpError(c.describe(n, f"takes the {word} of every element; give dims"))
        value = reduce(c, n, args["input"], args["dim"], bool(args.get("keepdim", False)))
        return as_result(c, n, value)

    return convert


def _adaptive_3d(c: Any, n: Any, x: Any, op: Op) -> Value:
    """AdaptiveAvgPool3d of (N, C, T, H, W) (a video network's head): the frames averaged
    where the output has one (their mean), or kept where it has them all (merged into the
    channels), then the 2-D pool of the frames (_adaptive_steps)."""
    shape = tuple(c.shape(x))
    out = tuple(c.shape(n))
    if len(shape) != 5 or op != Op.AVGPOOL2D or out[2] not in (1, shape[2]):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"pools {list(shape)} to {list(out)}; mexc averages (N, C, T, H, W) to one "
                "frame or to all of them",
            )
        )
    b, ch, t, h, w = shape
    v = c.arg(x)
    if out[2] == 1 and t > 1:
        v = mean_over(c, v, shape, [2], (b, ch, h, w))
        seen, to = (b, ch, h, w), (b, ch, out[3], out[4])
    else:
        seen, to = (b, ch * t, h, w), (b, ch * t, out[3], out[4])
        v = reshaped(c, v, seen)
    if to != seen:
        v = _adaptive_steps(c, n, v, seen, to, op, False)
    return as_result(c, n, v)


def _adaptive_module(op: Op, build: Callable[..., Value] | None = None) -> Callable[..., Value]:
    """The converter of AdaptiveAvgPool2d / AdaptiveMaxPool2d (`build` _adaptive_1d: the 1-D
    modules)."""

    def convert(c: Any, n: Any, m: Any) -> Value:
        if getattr(m, "return_indices", False):
            raise UnsupportedOpError(c.describe(n, "returns indices; use return_indices=False"))
        return (build or _adaptive)(c, n, n.args[0], op)

    return convert


def _adaptive_function(op: Op, build: Callable[..., Value] | None = None) -> Callable[..., Value]:
    """The converter of F.adaptive_{avg,max}_pool{1,2}d."""

    def convert(c: Any, n: Any) -> Value:
        if (n.args[2] if len(n.args) > 2 else n.kwargs.get("return_indices", False)) is True:
            raise UnsupportedOpError(c.describe(n, "returns indices; use return_indices=False"))
        return (build or _adaptive)(c, n, n.args[0], op)

    return convert


def _upsample(
    c: Any,
    n: Any,
    mode: Any,
    align_corners: Any = None,
    antialias: Any = False,
    scale_factor: Any = None,
) -> Value:
    """Nearest upsampling of (N, C, H, W), or (N, C, L) over (N, C, 1, L), by integer factors
    read off the traced shapes (size or scale_factor; 'nearest-exact' picks the same pixels for
    integer factors). `scale_factor`: the one torch places the source pixels by (given and not
    recomputed from the sizes), which must then be the sizes' ratio. Other resamplings
    (align_corners=True, bicubic, other ratios) reach here only where the frontend could not
    write them as products (frontend_resample), and are refused."""
    x = n.args[0]
    x_shape, out = c.shape(x), c.shape(n)
    refusal = resampling_refusal(
        mode, tuple(x_shape[2:]), tuple(out[2:]), align_corners, antialias, scale_factor
    )
    if refusal is not None:
        raise UnsupportedOpError(c.describe(n, refusal))
    if mode in ("linear", "bilinear"):
        return linear_resample(c, n, x)
    if any(o < i for i, o in zip(x_shape[2:], out[2:])):  # down along some axis first
        v, shape = _nearest_down(c, n, c.arg(x), tuple(x_shape), tuple(out), mode)
        if shape == tuple(out):
            return as_result(c, n, v)
        up = tuple(o // i for i, o in zip(shape[2:], out[2:]))
        if len(up) == 1:
            wide = (*shape[:2], 1, out[2])
            y = c.emit_as(
                Op.UPSAMPLE_NEAREST,
                [reshaped(c, v, (*shape[:2], 1, shape[2]))],
                wide,
                scale=(1, up[0]),
            )
            return as_result(c, n, y)
        return c.emit(Op.UPSAMPLE_NEAREST, [v], n, scale=up)
    scale = tuple(o // i for i, o in zip(x_shape[2:], out[2:]))
    if scale in ((1,), (1, 1)):
        return c.arg(x)
    if len(scale) == 1:  # (N, C, L): over (N, C, 1, L)
        wide = (*x_shape[:2], 1, out[2])
        y = c.emit_as(Op.UPSAMPLE_NEAREST, [as_rows_2d(c, x)], wide, scale=(1, scale[0]))
        return as_result(c, n, y)
    return c.emit(Op.UPSAMPLE_NEAREST, [c.arg(x)], n, scale=scale)


def resampling_refusal(
    mode: Any,
    sizes: tuple[int, ...],
    out: tuple[int, ...],
    align_corners: Any,
    antialias: Any,
    factor: Any,
) -> str | None:
    """Why _upsample does not lower a resampling of spatial `sizes` to `out` with its own ops;
    None where it does: of (N, C, L) or (N, C, H, W), nearest or nearest-exact, and linear or
    bilinear with align_corners=False and no antialias, up or down by integer factors along
    each axis, placed by the sizes' ratio."""
    if len(sizes) not in (1, 2):
        return f"upsamples a {len(sizes) + 2}-D tensor; mexc upsamples (N, C, L) and (N, C, H, W)"
    if factor is not None:
        factors = factor if isinstance(factor, (list, tuple)) else (factor,) * len(sizes)
        for f, i, o in zip(factors, sizes, out):
            if abs(float(f) - o / i) > 1e-9 * (o / i):
                return (
                    f"resamples {list(sizes)} to {list(out)} with scale_factor {factor}, whose "
                    "pixel positions are not the sizes' ratio; give size= or "
                    "recompute_scale_factor=True"
                )
    if mode not in ("nearest", "nearest-exact", "linear", "bilinear"):
        return (
            f"upsamples with mode {mode!r}; mexc lowers nearest, linear and bilinear "
            "upsampling by integer factors"
        )
    if any(o % i and i % o for i, o in zip(sizes, out)):
        return (
            f"resamples {list(sizes)} to {list(out)}; mexc lowers resampling by integer "
            "factors only"
        )
    if mode in ("linear", "bilinear") and antialias:
        return "resamples with antialias=True"
    if mode in ("linear", "bilinear") and align_corners:
        return (
            "upsamples with align_corners=True, whose weights vary across the output; mexc "
            "lowers align_corners=False"
        )
    return None


def _nearest_down(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], out: tuple[int, ...], mode: str
) -> tuple[Value, tuple[int, ...]]:
    """v downsampled, nearest, along each axis whose output is a whole fraction 1/s of its
    input: torch reads source pixel floor(j s) ('nearest'; floor((j + 1/2) s) 'nearest-exact'),
    one pixel of each window of s: v seen as (..., out, s, ...) and that pixel sliced out.
    Exact, and its gradient is the slice's (zeros elsewhere). Returns (v, its shape)."""
    for axis in range(2, len(shape)):
        size, o = shape[axis], out[axis]
        if o >= size:
            continue
        step = size // o
        at = step // 2 if mode == "nearest-exact" else 0
        windows = (*shape[:axis], o, step, *shape[axis + 1 :])
        picked = sliced(c, reshaped(c, v, windows), windows, axis + 1, at, at + 1)
        shape = (*shape[:axis], o, *shape[axis + 1 :])
        v = reshaped(c, picked, shape)
    return v, shape


def _placing_factor(scale_factor: Any, recompute: Any) -> Any:
    """The scale_factor torch places source pixels by: None where sizes decide."""
    return None if scale_factor is None or recompute else static_value(scale_factor)


def resampling_arguments(n: Any, m: Any = None) -> tuple[Any, Any, Any, Any]:
    """(mode, align_corners, antialias, the placing scale_factor) of a resampling node: an
    nn.Upsample module `m` (UpsamplingNearest2d, UpsamplingBilinear2d), F.interpolate,
    F.upsample, or F.upsample_nearest."""
    if m is not None:
        factor = _placing_factor(m.scale_factor, getattr(m, "recompute_scale_factor", None))
        return getattr(m, "mode", "nearest"), getattr(m, "align_corners", None), False, factor
    name = getattr(n.target, "__name__", "")
    if name in ("upsample_nearest", "upsample_bilinear"):  # bilinear: align_corners=True
        args = dict(zip(("input", "size", "scale_factor"), n.args)) | dict(n.kwargs)
        factor = _placing_factor(args.get("scale_factor"), None)
        return (
            ("nearest", None, False, factor)
            if name == "upsample_nearest"
            else ("bilinear", True, False, factor)
        )
    names = (
        "input",
        "size",
        "scale_factor",
        "mode",
        "align_corners",
        "recompute_scale_factor",
        "antialias",
    )
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    mode = static_value(args.get("mode", "nearest"))
    factor = _placing_factor(args.get("scale_factor"), args.get("recompute_scale_factor"))
    corners, antialias = args.get("align_corners"), args.get("antialias", False)
    return mode, static_value(corners), static_value(antialias), factor


def _upsample_module(c: Any, n: Any, m: Any) -> Value:
    return _upsample(c, n, *resampling_arguments(n, m))


def _interpolate(c: Any, n: Any) -> Value:
    return _upsample(c, n, *resampling_arguments(n))


def _upsample_fwd(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.upsample_nearest_forward(a[0], n.attrs.scale),)


def _upsample_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.upsample_nearest_backward(a[0], n.attrs.scale, env.ctx, tid(n)),)


def _tir(name: str) -> str:
    return f"step_plan:PlanRules.{name}"


define(
    OpDef(
        Op.MAXPOOL2D,
        dict(_MAXPOOL),
        types=with_index_types,
        vjp=_maxpool_vjp,
        reference=_maxpool,
        frontend=(
            Pattern("module", ("torch.nn.MaxPool2d",), _pool_module(Op.MAXPOOL2D)),
            Pattern("function", ("torch.nn.functional.max_pool2d",), _pool_function(Op.MAXPOOL2D)),
            Pattern("module", ("torch.nn.AdaptiveMaxPool2d",), _adaptive_module(Op.MAXPOOL2D)),
            Pattern("module", ("torch.nn.MaxPool1d",), _pool_module(Op.MAXPOOL2D, _pool1d)),
            Pattern("function", ("torch.max",), _extreme_call(True)),
            Pattern("method", ("max",), _extreme_call(True)),
            Pattern("function", ("torch.amax",), _extreme_over(True)),
            Pattern("method", ("amax",), _extreme_over(True)),
            Pattern("function", ("torch.min",), _extreme_call(False)),
            Pattern("method", ("min",), _extreme_call(False)),
            Pattern("function", ("torch.amin",), _extreme_over(False)),
            Pattern("method", ("amin",), _extreme_over(False)),
            Pattern(
                "function",
                ("torch.nn.functional.max_pool1d",),
                _pool_function(Op.MAXPOOL2D, _pool1d),
            ),
            Pattern(
                "module",
                ("torch.nn.AdaptiveMaxPool1d",),
                _adaptive_module(Op.MAXPOOL2D, _adaptive_1d),
            ),
            Pattern(
                "function",
                ("torch.nn.functional.adaptive_max_pool1d",),
                _adaptive_function(Op.MAXPOOL2D, _adaptive_1d),
            ),
            Pattern(
                "function",
                ("torch.nn.functional.adaptive_max_pool2d",),
                _adaptive_function(Op.MAXPOOL2D),
            ),
        ),
        lower={"tir": _tir("maxpool"), "c": "emit:_maxpool"},
        doc="max pooling; the second result is the argmax offset in its window",
        data_parallel=True,
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
            Pattern("module", ("torch.nn.AvgPool1d",), _pool_module(Op.AVGPOOL2D, _pool1d)),
            Pattern(
                "function",
                ("torch.nn.functional.avg_pool1d",),
                _pool_function(Op.AVGPOOL2D, _pool1d),
            ),
        ),
        lower={"tir": _tir("avgpool"), "c": "emit:_avgpool"},
        doc="average pooling (zero padding counted), divided exactly and rounded",
        data_parallel=True,
    ),
    OpDef(
        Op.GLOBAL_AVGPOOL,
        {"rid": -1},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.GLOBAL_AVGPOOL_GRAD, no_saved),
        reference=_gap,
        frontend=(
            Pattern("module", ("torch.nn.AdaptiveAvgPool2d",), _adaptive_module(Op.AVGPOOL2D)),
            Pattern(
                "module",
                ("torch.nn.AdaptiveAvgPool3d",),
                _adaptive_module(Op.AVGPOOL2D, _adaptive_3d),
            ),
            Pattern(
                "module",
                ("torch.nn.AdaptiveAvgPool1d",),
                _adaptive_module(Op.AVGPOOL2D, _adaptive_1d),
            ),
            Pattern(
                "function",
                ("torch.nn.functional.adaptive_avg_pool1d",),
                _adaptive_function(Op.AVGPOOL2D, _adaptive_1d),
            ),
            Pattern(
                "function",
                ("torch.nn.functional.adaptive_avg_pool2d",),
                _adaptive_function(Op.AVGPOOL2D),
            ),
        ),
        lower={"tir": _tir("avgpool"), "c": "emit:_gap"},
        doc="mean over the spatial axes: [N, C, H, W] -> [N, C, 1, 1]",
        data_parallel=True,
    ),
    OpDef(
        Op.UPSAMPLE_NEAREST,
        {"scale": (2, 2)},
        types=elementwise_types,
        vjp=pointwise_vjp(Op.UPSAMPLE_NEAREST_GRAD, no_saved),
        reference=_upsample_fwd,
        frontend=(
            Pattern("module", ("torch.nn.Upsample",), _upsample_module),
            Pattern("module", ("torch.nn.UpsamplingNearest2d",), _upsample_module),
            Pattern(
                "function",
                ("torch.nn.functional.interpolate", "torch.nn.functional.upsample"),
                _interpolate,
            ),
            Pattern("function", ("torch.nn.functional.upsample_nearest",), _interpolate),
        ),
        lower={"tir": _tir("upsample_nearest"), "c": "emit:_upsample_nearest"},
        doc="nearest upsampling by integer factors: each pixel repeated, the exponent kept",
        data_parallel=True,
    ),
    OpDef(
        Op.MAXPOOL2D_GRAD,
        {**_MAXPOOL, "rid": -1},
        reference=_maxpool_grad,
        lower={"tir": _tir("maxpool_grad"), "c": "emit:_maxpool_grad"},
        doc="dy scattered to the argmax of each window",
        data_parallel=True,
    ),
    OpDef(
        Op.AVGPOOL2D_GRAD,
        {**_POOL, "rid": -1},
        reference=_avgpool_grad,
        lower={"tir": _tir("avgpool_grad"), "c": "emit:_avgpool_grad"},
        doc="dy spread evenly over each window",
        data_parallel=True,
    ),
    OpDef(
        Op.UPSAMPLE_NEAREST_GRAD,
        {"scale": (2, 2), "rid": -1},
        reference=_upsample_grad,
        lower={"tir": _tir("upsample_nearest_grad"), "c": "emit:_upsample_nearest_grad"},
        doc="dy summed over each pixel's block of copies, one compaction",
        data_parallel=True,
    ),
    OpDef(
        Op.GLOBAL_AVGPOOL_GRAD,
        {"rid": -1},
        reference=_gap_grad,
        lower={"tir": _tir("avgpool_grad"), "c": "emit:_gap_grad"},
        doc="dy spread evenly over the spatial axes",
        data_parallel=True,
    ),
)
