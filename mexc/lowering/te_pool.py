"""Average pooling, global average pooling, ReLU6, LeakyReLU, Hardswish and dropout as TIR
kernels.

The TE form of kernels.pool (avgpool2d_*, global_avgpool_*: a global pool is an average pool
whose one window is the whole image, with the same rounding sites and flat indices),
kernels.activation.relu6_*, kernels.elementwise's dropout (residual and gradient sums are
te_ops.aligned_sum_acc). Exponents are one-element run-time buffers; the divisions by the
window size are numerics.div_const (multiply-and-shift by the precomputed reciprocal of the
odd part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from tvm import te, tirx

from mexc.kernels.activation import CLAMP_LEFT_CAP, HS_GRID, HSIG_BITS, HSIG_GRAD_LEFT
from mexc.lowering.te_compaction import _flat_index, fused_compaction, iabs, random_word, where
from mexc.lowering.te_compaction import _i64 as _c
from mexc.lowering.te_func import prim_func
from mexc.lowering.te_ops import window_through
from mexc.numerics import Reciprocal

I8, I32, I64 = "int8", "int32", "int64"
Pair = tuple[int, int]
Shape4 = tuple[int, int, int, int]
DIV_BITS = 15


def _func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    return prim_func(args, name)


def div_const(x: tirx.PrimExpr, recip: Reciprocal) -> tirx.PrimExpr:
    """numerics.div_const's mantissa: sign(x) * (((|x| + (o-1)/2) * mult) >> shift), int64."""
    q = ((iabs(x) + (recip.odd - 1) // 2) * _c(recip.mult)) >> _c(recip.shift)
    return where(x < 0, -q, q)


def exponent_offset(delta: int, name: str) -> tirx.PrimFunc:
    """e_out = e + delta (a static change of exponent: a pre-shift, a power-of-two divisor)."""
    e = te.placeholder((1,), I32, name="e")
    out = te.compute((1,), lambda i: e[i] + delta, name="e_out")
    return _func([e, out], name)


def out_size(x_shape: Shape4, k: Pair, s: Pair, p: Pair) -> Shape4:
    n, c, h, w = x_shape
    return (n, c, (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1)


def window_sum(x_shape: Shape4, k: Pair, s: Pair, p: Pair, left: int, name: str) -> tirx.PrimFunc:
    """acc = (sum of each window, zero padding counted) << left. Parameters (x, acc)."""
    _, _, h, w = x_shape
    x = te.placeholder(x_shape, I8, name="x")
    ri, rj = te.reduce_axis((0, k[0]), "ri"), te.reduce_axis((0, k[1]), "rj")

    def body(n, c, oy, ox):
        iy, ix = oy * s[0] + ri - p[0], ox * s[1] + rj - p[1]
        ok = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        v = x[n, c, tirx.if_then_else(ok, iy, 0), tirx.if_then_else(ok, ix, 0)].astype(I32)
        return te.sum(where(ok, v, tirx.const(0, I32)), axis=[ri, rj])

    total = te.compute(out_size(x_shape, k, s, p), body, name="total")
    acc = te.compute(total.shape, lambda *i: total[i] << left, name="acc")
    return _func([x, acc], name)


def divide(shape: tuple[int, ...], divisor: int, name: str) -> tirx.PrimFunc:
    """q = div_const(a) (|a| <= 2^15), e_q = e_a - pow2. Parameters (a, e_a, q, e_q)."""
    recip = Reciprocal.of(divisor)
    a = te.placeholder(shape, I32, name="a")
    e_a = te.placeholder((1,), I32, name="e_a")
    q = te.compute(shape, lambda *i: div_const(a[i].astype(I64), recip).astype(I32), name="q")
    e_q = te.compute((1,), lambda i: e_a[i] - recip.pow2, name="e_q")
    return _func([a, e_a, q, e_q], name)


def avgpool_backward_acc(x_shape: Shape4, k: Pair, s: Pair, p: Pair, name: str) -> tirx.PrimFunc:
    """acc[x] = sum over the windows holding x of g, g = div_const(dy << 8, K*K) (exponent
    e_dy - 8 - pow2, exact). Parameters (dy, e_dy, acc, e_acc)."""
    y_shape = out_size(x_shape, k, s, p)
    _, _, oh, ow = y_shape
    recip = Reciprocal.of(k[0] * k[1])
    dy = te.placeholder(y_shape, I8, name="dy")
    e_dy = te.placeholder((1,), I32, name="e_dy")

    def share(n, c, sy, sx):  # one window's gradient, spread over its K*K pixels
        return div_const(dy[n, c, sy, sx].astype(I64) << _c(DIV_BITS - 7), recip)

    if tuple(k) == tuple(s) and tuple(p) == (0, 0):
        # windows tile the input without overlap (a global pool, 2x2 stride 2): each pixel is
        # in at most one window, so the sum over taps has one term; the sum form tested all
        # K*K taps per pixel (SmallResNet's 8x8 global pool: 64 per pixel, 2.8 ms a step)
        def single(n, c, yy, xx):
            sy, sx = yy // s[0], xx // s[1]
            ok = tirx.all(sy < oh, sx < ow)
            g = share(n, c, tirx.min(sy, oh - 1), tirx.min(sx, ow - 1))
            return where(ok, g, _c(0)).astype(I32)

        acc = te.compute(x_shape, single, name="acc")
    else:
        ri, rj = te.reduce_axis((0, k[0]), "ri"), te.reduce_axis((0, k[1]), "rj")

        def body(n, c, yy, xx):
            sy, sx, ok = window_through(yy, xx, ri, rj, s, p, (oh, ow))
            return te.sum(where(ok, share(n, c, sy, sx), _c(0)), axis=[ri, rj])

        total = te.compute(x_shape, body, name="total")
        acc = te.compute(x_shape, lambda *i: total[i].astype(I32), name="acc")
    e_acc = te.compute((1,), lambda i: e_dy[i] - (DIV_BITS - 7) - recip.pow2, name="e_acc")
    return _func([dy, e_dy, acc, e_acc], name)


Bound = tuple[int, int] | None  # kernels.activation.clamp_bound's (num, shift), or absent


def _bound_at(bound: tuple[int, int], e: tirx.PrimExpr, ceil: bool) -> tirx.PrimExpr:
    """kernels.activation.bound_mantissa at the run-time exponent e (int32 lanes)."""
    num, shift = bound
    t = tirx.const(-shift, I32) - e
    n32 = tirx.const(num, I32)
    left = n32 << tirx.min(t, tirx.const(CLAMP_LEFT_CAP, I32))
    k = tirx.min(-t, tirx.const(31, I32))
    right = -((-n32) >> k) if ceil else n32 >> k
    return tirx.if_then_else(t >= 0, left, right)


def clamp_forward(
    shape: tuple[int, ...], lo: Bound, hi: Bound, top: int, name: str
) -> tirx.PrimFunc:
    """kernels.activation.clamp_forward: y = min(max(m, L), H) with the bounds at the input's
    exponent, L capped at `top`, H at -top. Parameters (x, e, y)."""
    x = te.placeholder(shape, I8, name="x")
    e = te.placeholder((1,), I32, name="e")
    cap = tirx.const(top, I32)
    low = te.compute(
        (1,), lambda _: tirx.min(_bound_at(lo, e[0], True), cap) if lo else -cap - 1, name="low"
    )
    high = te.compute(
        (1,), lambda _: tirx.max(_bound_at(hi, e[0], False), -cap) if hi else cap, name="high"
    )

    def body(*i: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.min(tirx.max(x[i].astype(I32), low[0]), high[0]).astype(I8)

    return _func([x, e, te.compute(shape, body, name="y")], name)


def clamp_backward(shape: tuple[int, ...], lo: Bound, hi: Bound, name: str) -> tirx.PrimFunc:
    """kernels.activation.clamp_backward: dx = dy where lo < x < hi, decided on the input's
    mantissa. Parameters (dy, x, e, dx)."""
    dy = te.placeholder(shape, I8, name="dy")
    x = te.placeholder(shape, I8, name="x")
    e = te.placeholder((1,), I32, name="e")
    zero = tirx.const(0, I32)
    low = te.compute((1,), lambda _: _bound_at(lo, e[0], False) if lo else zero, name="low")
    high = te.compute((1,), lambda _: _bound_at(hi, e[0], True) if hi else zero, name="high")

    def body(*i: tirx.PrimExpr) -> tirx.PrimExpr:
        m = x[i].astype(I32)
        keep = tirx.const(True, "bool")
        if lo:
            keep = tirx.all(keep, m > low[0])
        if hi:
            keep = tirx.all(keep, m < high[0])
        return where(keep, dy[i], tirx.const(0, I8))

    return _func([dy, x, e, te.compute(shape, body, name="dx")], name)


def relu6_forward(shape: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """y = clip(m, 0, relu6_cap(e)). Parameters (x, e, y)."""
    x = te.placeholder(shape, I8, name="x")
    e = te.placeholder((1,), I32, name="e")

    def cap_of(_: tirx.PrimExpr) -> tirx.PrimExpr:
        ev = e[0].astype(I64)
        pos = tirx.min(_c(6) >> tirx.min(ev, _c(62)), _c(127))
        neg = tirx.min(_c(6) << tirx.min(-ev, _c(40)), _c(127))
        return tirx.if_then_else(ev >= 0, pos, neg).astype(I32)

    cap = te.compute((1,), cap_of, name="cap")
    y = te.compute(
        shape, lambda *i: tirx.max(tirx.min(x[i].astype(I32), cap[0]), 0).astype(I8), name="y"
    )
    return _func([x, e, y], name)


def relu6_backward(shape: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """dx = dy where 0 < m * 2^e < 6 (m, e of the ReLU6 input). Parameters (dy, x, e, dx)."""
    dy = te.placeholder(shape, I8, name="dy")
    x = te.placeholder(shape, I8, name="x")
    e = te.placeholder((1,), I32, name="e")

    def body(*i):  # int32 lanes: both sides stay below 2^15
        ev = e[0]
        m = x[i].astype(I32)
        lhs = m << tirx.min(tirx.max(ev, 0), 8)
        rhs = tirx.const(6, I32) << tirx.min(tirx.max(-ev, 0), 8)
        keep = tirx.all(m > 0, lhs < rhs)
        return where(keep, dy[i], tirx.const(0, I8))

    dx = te.compute(shape, body, name="dx")
    return _func([dy, x, e, dx], name)


def upsample_nearest_forward(x_shape: Shape4, scale: Pair, name: str) -> tirx.PrimFunc:
    """kernels.pool.upsample_nearest_forward: y[n, c, i, j] = x[n, c, i // sh, j // sw].
    Parameters (x, y)."""
    n, c, h, w = x_shape
    sh, sw = scale
    x = te.placeholder(x_shape, I8, name="x")
    y = te.compute((n, c, h * sh, w * sw), lambda a, b, i, j: x[a, b, i // sh, j // sw], name="y")
    return _func([x, y], name)


def upsample_nearest_backward_acc(x_shape: Shape4, scale: Pair, name: str) -> tirx.PrimFunc:
    """kernels.pool.upsample_nearest_backward before its compaction: acc[n, c, i, j] = the
    int32 sum of dy over the (sh, sw) block of copies of x[n, c, i, j]. Parameters (dy, acc)."""
    n, c, h, w = x_shape
    sh, sw = scale
    dy = te.placeholder((n, c, h * sh, w * sw), I8, name="dy")
    r = te.reduce_axis((0, sh), "up_r")
    q = te.reduce_axis((0, sw), "up_q")
    acc = te.compute(
        x_shape,
        lambda a, b, i, j: te.sum(dy[a, b, i * sh + r, j * sw + q].astype(I32), axis=[r, q]),
        name="acc",
    )
    return _func([dy, acc], name)


def leaky_relu_compaction(
    shape: tuple[int, ...],
    slope: tuple[int, int],
    grad: bool,
    bits: int,
    stochastic: bool,
    name: str,
    agreed: int = 0,
) -> tuple[tirx.PrimFunc, ...]:
    """kernels.activation.leaky_relu_forward (grad: leaky_relu_backward): acc = m 2^S where
    the mask's mantissa is > 0, m num elsewhere ((num, S) = `slope`, leaky_slope), at e - S,
    compacted without being stored (fused_compaction). Parameters start (x, e), or (dy, e_dy,
    saved) for the gradient."""
    num, shift = slope
    x = te.placeholder(shape, I8, name="dy" if grad else "x")
    e = te.placeholder((1,), I32, name="e_dy" if grad else "e")
    mask = te.placeholder(shape, I8, name="saved") if grad else x
    target = te.compute((1,), lambda i: e[i] - shift, name="target")

    def value(*i: tirx.PrimExpr) -> tirx.PrimExpr:
        m = x[i].astype(I32)
        return where(mask[i] > tirx.const(0, I8), m * (1 << shift), m * num)

    inputs = [x, e, mask] if grad else [x, e]
    return fused_compaction(shape, inputs, target, value, bits, stochastic, name, agreed)


def _hardswish_grid(m: tirx.PrimExpr, e: tirx.PrimExpr) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """kernels.activation._hardswish_grid on int64 values: (xk, k), k = clamp(-e, 0, 16)."""
    k = tirx.min(tirx.max(-e, _c(0)), _c(HS_GRID))
    s = k + e
    left = m << tirx.min(tirx.max(s, _c(0)), _c(3))
    r = tirx.min(tirx.max(-s, _c(1)), _c(31))  # the nearest right shift, used when s < 0
    right = (m + (_c(1) << (r - 1))) >> r
    return where(s >= 0, left, right), k


GridValue: TypeAlias = "Callable[[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]"


def _grid_acc(
    shape: tuple[int, ...],
    backward: bool,
    value: GridValue,
    exponent: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr],
    name: str,
) -> tirx.PrimFunc:
    """The accumulator of a hardswish-grid activation before its division by 6: acc =
    value(a, xk, k) (int64) with (xk, k) = x on the 2^-k grid, a = x's mantissa (forward) or
    dy's (backward); e_acc = exponent(e, k) (e: x's exponent) plus dy's exponent (backward).
    Parameters (x, e, acc, e_acc), or (dy, e_dy, x, e, acc, e_acc) for a gradient."""
    x = te.placeholder(shape, I8, name="x")
    e = te.placeholder((1,), I32, name="e")
    lead = [te.placeholder(shape, I8, name="dy"), te.placeholder((1,), I32, name="e_dy")]
    a = lead[0] if backward else x

    def body(*i: tirx.PrimExpr) -> tirx.PrimExpr:
        xk, k = _hardswish_grid(x[i].astype(I64), e[0].astype(I64))
        return value(a[i].astype(I64), xk, k).astype(I32)

    def exp(i: tirx.PrimExpr) -> tirx.PrimExpr:
        ev = e[i].astype(I64)
        k = tirx.min(tirx.max(-ev, _c(0)), _c(HS_GRID))
        base = lead[1][i].astype(I64) if backward else _c(0)
        return (base + exponent(ev, k)).astype(I32)

    acc = te.compute(shape, body, name="acc")
    e_acc = te.compute((1,), exp, name="e_acc")
    return _func([*(lead if backward else []), x, e, acc, e_acc], name)


def hardswish_acc(shape: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """acc = (m c) << max(0, 5 - k), c = clamp(xk + 3 2^k, 0, 6 2^k); e_acc = e - k - left
    (kernels.activation.hardswish_forward before its division). Parameters (x, e, acc, e_acc)."""

    def value(m: tirx.PrimExpr, xk: tirx.PrimExpr, k: tirx.PrimExpr) -> tirx.PrimExpr:
        c = tirx.min(tirx.max(xk + (_c(3) << k), _c(0)), _c(6) << k)
        return (m * c) << tirx.max(_c(5) - k, _c(0))

    return _grid_acc(shape, False, value, lambda e, k: e - k - tirx.max(_c(5) - k, _c(0)), name)


def hardswish_grad_acc(shape: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """acc = (m_dy G) << max(0, 4 - k), G = 0 | 6 2^k | 2 xk + 3 2^k; e_acc = e_dy - k - left
    (kernels.activation.hardswish_backward before its division). Parameters (dy, e_dy, x, e,
    acc, e_acc)."""

    def value(m: tirx.PrimExpr, xk: tirx.PrimExpr, k: tirx.PrimExpr) -> tirx.PrimExpr:
        three = _c(3) << k
        g = where(xk <= -three, _c(0), where(xk >= three, three * 2, xk * 2 + three))
        return (m * g) << tirx.max(_c(4) - k, _c(0))

    return _grid_acc(shape, True, value, lambda e, k: -k - tirx.max(_c(4) - k, _c(0)), name)


def hardsigmoid_acc(shape: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """acc = c << max(0, 12 - k), c = clamp(xk + 3 2^k, 0, 6 2^k); e_acc = -k - left
    (kernels.activation.hardsigmoid_forward before its division). Parameters (x, e, acc,
    e_acc)."""

    def value(m: tirx.PrimExpr, xk: tirx.PrimExpr, k: tirx.PrimExpr) -> tirx.PrimExpr:
        c = tirx.min(tirx.max(xk + (_c(3) << k), _c(0)), _c(6) << k)
        return c << tirx.max(_c(HSIG_BITS) - k, _c(0))

    return _grid_acc(
        shape, False, value, lambda e, k: -k - tirx.max(_c(HSIG_BITS) - k, _c(0)), name
    )


def hardsigmoid_grad_acc(shape: tuple[int, ...], name: str) -> tirx.PrimFunc:
    """acc = dy << 8 where -3 2^k < xk < 3 2^k, else 0; e_acc = e_dy - 8
    (kernels.activation.hardsigmoid_backward before its division). Parameters (dy, e_dy, x, e,
    acc, e_acc)."""

    def value(m: tirx.PrimExpr, xk: tirx.PrimExpr, k: tirx.PrimExpr) -> tirx.PrimExpr:
        three = _c(3) << k
        return where(tirx.all(xk > -three, xk < three), m << HSIG_GRAD_LEFT, _c(0))

    return _grid_acc(shape, True, value, lambda e, k: _c(-HSIG_GRAD_LEFT), name)


def dropout_forward_acc(
    shape: tuple[int, ...], keep_below: int, scale_num: int, name: str, per: int = 1
) -> tirx.PrimFunc:
    """mask = random word (key, flat index / per) < keep_below; acc = mask ? m * scale_num :
    0. Parameters (x, key, mask (int8 0/1), acc)."""
    x = te.placeholder(shape, I8, name="x")
    key = te.placeholder((1,), I64, name="key")

    def word(i: tuple[tirx.PrimExpr, ...]) -> tirx.PrimExpr:
        flat = _flat_index(shape, i)
        return random_word(key[0], flat if per == 1 else tirx.floordiv(flat, per))

    mask = te.compute(
        shape,
        lambda *i: tirx.if_then_else(word(i) < _c(keep_below), 1, 0).astype(I8),
        name="mask",
    )
    acc = te.compute(
        shape,
        lambda *i: where(mask[i] > 0, x[i].astype(I32) * scale_num, tirx.const(0, I32)),
        name="acc",
    )
    return _func([x, key, mask, acc], name)


def masked_scale_acc(shape: tuple[int, ...], scale_num: int, name: str) -> tirx.PrimFunc:
    """acc = mask ? dy * scale_num : 0 (dropout backward). Parameters (dy, mask, acc)."""
    dy = te.placeholder(shape, I8, name="dy")
    mask = te.placeholder(shape, I8, name="mask")
    acc = te.compute(
        shape,
        lambda *i: where(mask[i] > 0, dy[i].astype(I32) * scale_num, tirx.const(0, I32)),
        name="acc",
    )
    return _func([dy, mask, acc], name)
