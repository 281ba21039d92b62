"""Normalizations written out with torch ops, taken as the layer norm they compute.

Models that predate nn.RMSNorm, or keep their own, write the normalization out:

- RMSNorm (T5, LLaMA, many hand-written transformers):
  `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`.
- L2 normalization written with a sum: `x / x.pow(2).sum(-1, keepdim=True).sqrt()`, the root
  of D times the mean square (D the count summed), so RMSNorm over sqrt(D).
- LayerNorm (ConvNeXt's channels-first LayerNorm, the Annotated Transformer):
  `(x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True) + eps)`,
  `(x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + eps)`, `x.var(...)`.

mexc has no square root of an activation. Such a root, taken of a mean of squares or of a
variance, is a `RootMeanSquare` (`follow`): the frontend holds it, never computes it, and
follows it through `+ eps`, floors and casts. When it divides, or its reciprocal multiplies,
the tensor it was taken of, that quotient is the layer norm of docs/layers.md, "Normalizations
written out": about the mean where the numerator is x minus its mean, else about 0 (_over_rms).
Any other use of the root is refused by node (frontend._Ctx.arg).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Value
from mexc.ops.common import (
    called_name,
    finite_number,
    is_float_tensor,
    static_int,
    static_value,
)
from mexc.ops.norm import (
    ADDS,
    FLOORS,
    MAX_FLOOR,
    along,
    check_floor,
    floor_of,
    layer_normalized,
    over_rms,
)
from mexc.ops.tensor import ACTIVATION_DIVISORS, ACTIVATION_FACTORS, multiplied, scaled

ROOT_USES = (
    "mexc takes such a root only to normalize the tensor it was taken of, as RMSNorm and "
    "LayerNorm written out: x / torch.sqrt(x.pow(2).mean(dim, keepdim=True) + eps), "
    "x * torch.rsqrt(...), (x - u) / torch.sqrt(x.var(dim, keepdim=True) + eps) or "
    "(x - u) / (x.std(dim, keepdim=True) + eps) with u = x.mean(dim, keepdim=True); or use "
    "nn.LayerNorm / nn.RMSNorm"
)


@dataclass(frozen=True)
class RootMeanSquare:
    """(count * (mean(v^2 over `dims`) + eps_in)) ** (power / 2) + count ** 0.5 * eps_out of v
    (`of`, the value the mean was taken of; `node`, its traced node), v about its mean over
    `dims` where `centered` (var and std, their `correction` dividing by D - correction). power
    2 is a variance, 1 its root, -1 the root's reciprocal. count is 1 for a mean and D, the
    count of the entries summed, for a sum of squares; eps_in and eps_out are relative to the
    mean, so a normalization by the root is the one by the mean's root over sqrt(count)."""

    of: Value
    node: Any
    dims: tuple[int, ...]
    power: int
    centered: bool
    correction: int = 0
    eps_in: float = 0.0
    eps_out: float = 0.0
    walk: Walk = dataclasses.field(default_factory=lambda: Walk())
    count: int = 1

    def relative(self, eps: float, power: int) -> float:
        """An eps added to (or a floor of) the sum (power 2) or its root (1), relative to the
        mean or its root."""
        return eps / (self.count if power == 2 else math.sqrt(self.count))


@dataclass
class Walk:
    """The traced nodes a match read: those it matched as the normalization's own ops
    (`computed`: the square, the mean, x - u, ...) and the tensors they read (`leaves`: x)."""

    computed: set[Any] = dataclasses.field(default_factory=set)
    leaves: set[Any] = dataclasses.field(default_factory=set)

    def merged(self, other: Walk) -> Walk:
        return Walk(self.computed | other.computed, self.leaves | other.leaves)

    def changed_within(self, c: Any) -> bool:
        """A node it read was changed in place after the first of its own ops ran (a change
        before that one, every op of it saw)."""
        first = min((c.position.get(m, 0) for m in self.computed), default=0)
        return any(c.rebound.get(m, -1) >= first for m in self.computed | self.leaves)


_ROOTS = {"sqrt": 1, "rsqrt": -1}
_POWERS = ("pow", "__pow__", "float_power")
_SPREADS = {"var": 2, "std": 1}
_CASTS = ("to", "float", "type_as", "contiguous")
_EXPANDS = ("expand", "expand_as", "broadcast_to")  # timm's FilterResponseNorm, EvoNorm
_PRODUCTS = ("mul", "__mul__", "__rmul__", "imul", "mul_")
_QUOTIENTS = ("truediv", "div", "true_divide", "__truediv__", "itruediv", "div_")
_SQUARES = ("square",)
_MEANS = ("mean",)
_SUMS = ("sum",)
_SUBS = ("sub", "__sub__", "subtract")
_AUGMENTED = ("iadd", "isub", "imul", "itruediv")  # x += ..., traced as in place


def follow(c: Any, n: Any) -> RootMeanSquare | None:
    """The RootMeanSquare node n computes: a root or reciprocal root of a mean of squares, a
    variance or standard deviation, or such a root with an eps added, floored or cast; None
    for any other node (a product or quotient with a root goes to the converters, which
    normalize through ACTIVATION_FACTORS and ACTIVATION_DIVISORS). Another use of a root is
    refused here, naming n."""
    if n.op not in ("call_function", "call_method"):
        return None
    name = called_name(n)
    args = list(n.args)
    root = next((r for a in args if (r := _root(c, a)) is not None), None)
    if root is None:
        if not (args and isinstance(_held(c, args[0]), Value)):
            return None  # a constant's root is folded on the host (frontend_fold)
        power = _root_power(n, name)
        if power is not None:
            return _root_of_mean_square(c, n, args[0], power)
        return _spread(c, n, name) if name in _SPREADS else None
    if _root(c, args[0]) is root and (name.endswith("_") or name in _AUGMENTED):
        raise UnsupportedOpError(
            c.describe(n, f"changes a root mean square in place (`{name}`); {ROOT_USES}")
        )
    if name in _QUOTIENTS:
        inverse = _reciprocal(c, n)
        if inverse is not None:
            return inverse
    if name in _PRODUCTS or (name in _QUOTIENTS and _root(c, args[0]) is not root):
        return None  # the converters' ACTIVATION_FACTORS and ACTIVATION_DIVISORS
    power = _root_power(n, name)
    if power is not None and root.power == 2 and _root(c, args[0]) is root:
        return dataclasses.replace(root, power=power)
    other = next((a for a in args if _root(c, a) is not root), None)
    number = static_value(other)
    if name in ADDS and len(args) == 2 and _is_eps(number) and root.power in (1, 2):
        field = "eps_out" if root.power == 1 else "eps_in"
        eps = root.relative(float(number), root.power)
        return dataclasses.replace(root, **{field: getattr(root, field) + eps})
    low = n.kwargs.get("min", args[1] if len(args) > 1 else None)
    if name in FLOORS and "max" not in n.kwargs and len(args) <= 2 and _is_eps(low):
        field = "eps_out" if root.power == 1 else "eps_in"
        if root.power in (1, 2):
            _check_floor(c, n, float(low))
            eps = root.relative(float(low), root.power)
            return dataclasses.replace(root, **{field: max(getattr(root, field), eps)})
    if name in _CASTS and is_float_tensor(n):
        return root
    if name in _EXPANDS and _rank(n) == _rank(args[0]):
        return root  # broadcast over the reduced axes, as the product with it broadcasts
    raise UnsupportedOpError(
        c.describe(n, f"uses the root mean square of a tensor in `{name}`; {ROOT_USES}")
    )


def _held(c: Any, a: Any) -> Any:
    return c.env.get(a) if c.is_node(a) else None


def _is_eps(v: Any) -> bool:
    return finite_number(v) and v >= 0


def _rank(n: Any) -> int | None:
    shape = getattr(n.meta.get("tensor_meta"), "shape", None)
    return None if shape is None else len(shape)


def _root_power(n: Any, name: str) -> int | None:
    """1 for a square root (torch.sqrt, x ** 0.5, torch.pow(x, 0.5)), -1 for a reciprocal one
    (torch.rsqrt, x ** -0.5), None for another call."""
    if name in _ROOTS:
        return _ROOTS[name]
    if name in _POWERS and len(n.args) + len(n.kwargs) == 2:
        k = static_value(n.args[1] if len(n.args) > 1 else n.kwargs.get("exponent"))
        return {0.5: 1, -0.5: -1}.get(k) if isinstance(k, float) else None
    return None


def _root_of_mean_square(c: Any, n: Any, arg: Any, power: int) -> RootMeanSquare:
    """The root (power 1) or reciprocal root (-1) of mean(v^2, dims, keepdim=True) + eps."""
    walk = Walk({n})
    m, eps = arg, 0.0
    while called_name(m) in (*ADDS, *FLOORS):
        floor = floor_of(m)
        if floor is None:
            break
        added = called_name(m) in ADDS
        walk.computed.add(m)
        m, e = floor
        if not added:
            _check_floor(c, n, e)  # a floor differs from an added eps where it is large
        eps = eps + e if added else max(eps, e)
    mean = _mean_call(c, m, walk, sums=True)
    v = _square_of(c, mean[0], walk) if mean is not None else None
    if mean is None or v is None:
        raise UnsupportedOpError(
            c.describe(
                n,
                "takes the square root of an activation; mexc takes one only of a mean or sum "
                f"of squares or a variance (plus eps); {ROOT_USES}",
            )
        )
    dims = _dims(c, n, v, mean[1])
    shape = tuple(c.shape(v))
    count = int(np.prod([shape[d] for d in dims])) if called_name(m) in _SUMS else 1
    root = RootMeanSquare(c.arg(v), v, dims, power, False, walk=walk, count=count)
    return dataclasses.replace(root, eps_in=root.relative(eps, 2))


def _check_floor(c: Any, n: Any, eps: float) -> None:
    check_floor(
        c, n, eps, "floors a mean of squares or a root", "adds the floor, which is torch's max"
    )


def _mean_call(c: Any, m: Any, walk: Walk, sums: bool = False) -> tuple[Any, Any] | None:
    """(x, dim) where m is x.mean(dim, keepdim=True) or torch.mean(x, dim, True) (or, where
    `sums`, x.sum(dim, keepdim=True))."""
    if not c.is_node(m) or called_name(m) not in (*_MEANS, *(_SUMS if sums else ())):
        return None
    args = dict(zip(("input", "dim", "keepdim"), m.args)) | dict(m.kwargs)
    if not static_value(args.get("keepdim", False)) or args.get("dim") is None:
        return None
    walk.computed.add(m)
    return args["input"], args["dim"]


def _square_of(c: Any, q: Any, walk: Walk) -> Any:
    """v where q is v * v, v ** 2, v.pow(2), torch.square(v); else None."""
    if not c.is_node(q):
        return None
    name, args = called_name(q), list(q.args)
    v = None
    product = name in ("mul", "__mul__") and len(args) == 2
    if (name in _SQUARES and args) or (product and same_tensor(c, args[0], args[1], walk)):
        v = args[0]
    elif name in _POWERS and len(args) + len(q.kwargs) == 2:
        k = static_value(args[1] if len(args) > 1 else q.kwargs.get("exponent"))
        v = args[0] if k in (2, 2.0) and not isinstance(k, bool) else None
    if v is not None:
        walk.computed.add(q)
        walk.leaves.add(v)
    return v


def _spread(c: Any, n: Any, name: str) -> RootMeanSquare:
    """x.var(dim, keepdim=True) or x.std(...), with `unbiased` or `correction`."""
    args = dict(zip(("input", "dim", "unbiased", "keepdim"), n.args)) | dict(n.kwargs)
    if not static_value(args.get("keepdim", False)) or args.get("dim") is None:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"takes a {name} without keepdim=True or without dims; mexc takes one over "
                f"named axes with keepdim=True, to normalize the tensor by; {ROOT_USES}",
            )
        )
    correction = args.get("correction")
    if correction is None:
        correction = 1 if static_value(args.get("unbiased", True)) else 0
    x = args["input"]
    dims = _dims(c, n, x, args["dim"])
    walk = Walk({n}, {x})
    return RootMeanSquare(
        c.arg(x), x, dims, _SPREADS[name], True, static_int(correction), walk=walk
    )


def _dims(c: Any, n: Any, x: Any, dim: Any) -> tuple[int, ...]:
    shape = tuple(c.shape(x))
    value = static_value(dim)
    axes = value if isinstance(value, (list, tuple)) else [value]
    # no dims (mean(x, [])) is every axis, as in torch
    dims = tuple(sorted({static_int(d) % len(shape) for d in axes})) or tuple(range(len(shape)))
    if c.first_or_batch_axis(c.arg(x)) in dims:
        raise UnsupportedOpError(c.describe(n, "takes a mean of squares along the batch axis"))
    return dims


# calls whose two traced calls give two tensors (a random draw each)
_RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "drop_path")


def same_tensor(c: Any, a: Any, b: Any, walk: Walk, depth: int = 4) -> bool:
    """a and b are the same tensor: the same node, nodes bound to the same value (a cast), or
    the same call of the same tensors (`(x - u)` written twice; not a random op's). The nodes
    compared go into `walk` (Walk.changed_within tells whether one changed in place)."""
    if not (c.is_node(a) and c.is_node(b)):
        return not c.is_node(a) and not c.is_node(b) and static_value(a) == static_value(b)
    va, vb = c.env.get(a), c.env.get(b)
    if a is b or (isinstance(va, Value) and va is vb):
        walk.leaves.update((a, b))
        return True
    if depth == 0 or a.op != b.op or a.target != b.target:
        return False
    if a.op not in ("call_function", "call_method") or any(r in called_name(a) for r in _RANDOM):
        return False
    if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return False
    pairs = [*zip(a.args, b.args), *((a.kwargs[k], b.kwargs[k]) for k in a.kwargs)]
    if not all(same_tensor(c, x, y, walk, depth - 1) for x, y in pairs):
        return False
    walk.computed.update((a, b))
    return True


def _centered(c: Any, a: Any, dims: tuple[int, ...], walk: Walk) -> Any:
    """x where a is x - x.mean(dims, keepdim=True) (the same x), else None."""
    if not c.is_node(a) or called_name(a) not in _SUBS or len(a.args) != 2:
        return None
    x, u = a.args
    mean = _mean_call(c, u, walk)
    if mean is None or not same_tensor(c, mean[0], x, walk) or not c.is_node(x):
        return None
    if _dims(c, u, x, mean[1]) != dims:
        return None
    walk.computed.add(a)
    return x


def _root(c: Any, b: Any) -> RootMeanSquare | None:
    r = _held(c, b)
    return r if isinstance(r, RootMeanSquare) else None


def _times_inverse_root(c: Any, n: Any, a: Any, b: Any) -> Value | None:
    """a * b where one is the reciprocal root of the other's mean square (RMSNorm)."""
    for x, r in ((a, _root(c, b)), (b, _root(c, a))):
        if r is not None:
            if r.power != -1:
                raise UnsupportedOpError(
                    c.describe(n, f"multiplies by a root mean square; {ROOT_USES}")
                )
            return _normalized(c, n, x, r)
    return None


def _over_root(c: Any, n: Any, a: Any, b: Any) -> Value | None:
    """a / b where b is the root of a's mean square or variance (plus eps)."""
    r = _root(c, b)
    if r is None:
        return None
    if r.power != 1:
        raise UnsupportedOpError(
            c.describe(n, f"divides by a mean of squares that is not rooted; {ROOT_USES}")
        )
    return _normalized(c, n, a, r)


def _reciprocal(c: Any, n: Any) -> RootMeanSquare | None:
    """1 / b for a root b: its reciprocal (and back); None where n is another quotient."""
    a, b = (list(n.args) + [None, None])[:2]
    r = _root(c, b)
    if r is None or static_value(a) != 1 or r.power not in (1, -1):
        return None
    return dataclasses.replace(r, power=-r.power)


def _normalized(c: Any, n: Any, a: Any, r: RootMeanSquare) -> Value:
    """a normalized by r, a's own root mean square; or a parameter times that tensor, then
    times the parameter (the Annotated Transformer's a_2 * (x - mean) / (std + eps))."""
    factor = None
    walk = _normalizes(c, a, r)
    if walk is None and called_name(a) in ("mul", "__mul__") and len(a.args) == 2:
        p, q = a.args if c.is_param(a.args[0]) else a.args[::-1]
        walk = _normalizes(c, q, r) if c.is_param(p) else None
        if walk is not None:
            walk.computed.add(a)
            factor, a = p, q
    if walk is None:
        raise UnsupportedOpError(
            c.describe(
                n, f"normalizes a tensor by the root mean square of another tensor; {ROOT_USES}"
            )
        )
    # about the mean: r a variance of x, or the mean square of a = x - x.mean(dims)
    x = r.node if r.centered else _centered(c, a, r.dims, walk)
    if walk.changed_within(c) or c.arg(r.node) is not r.of:
        raise UnsupportedOpError(
            c.describe(
                n,
                "normalizes a tensor by a root mean square, and the tensor or a step between "
                "them was changed in place in between; mexc takes the normalization only "
                f"where each step reads what the one before computed ({ROOT_USES})",
            )
        )
    source = x if x is not None else a
    shape = tuple(c.shape(source))
    if tuple(c.shape(n)) != shape:
        raise UnsupportedOpError(c.describe(n, f"normalizes to a broadcast shape; {ROOT_USES}"))
    if r.eps_out > MAX_FLOOR:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"adds {r.eps_out} to a root mean square; mexc adds eps^2 under the root, "
                f"which is torch's root + eps within eps only for eps <= {MAX_FLOOR}",
            )
        )
    d = int(np.prod([shape[i] for i in r.dims]))
    kept = d - (r.correction if r.centered else 0)
    if kept <= 0:
        raise UnsupportedOpError(
            c.describe(n, f"takes a variance of {d} element(s) with correction {r.correction}")
        )
    ratio = kept / d  # torch's variance divides by d - correction: y = sqrt(ratio) LN(x)
    eps = max((r.eps_in + r.eps_out**2) * ratio, 1e-30)
    norm: Callable[[Value, tuple[int, ...]], Value]
    if x is not None:

        def norm(u: Value, flat: tuple[int, ...]) -> Value:
            return layer_normalized(c, n, u, flat, eps)
    else:

        def norm(u: Value, flat: tuple[int, ...]) -> Value:
            return over_rms(c, n, u, flat, eps)

    y = along(c, c.arg(source), shape, r.dims, norm)
    if ratio / r.count != 1:  # a root of a sum of squares is sqrt(count) times the mean's
        y = scaled(c, y, shape, math.sqrt(ratio / r.count))
    if factor is None:
        return y
    if K.factor_view(shape, tuple(c.shape(factor))) is None:
        raise UnsupportedOpError(
            c.describe(n, f"scales a normalization by a parameter of shape {list(c.shape(factor))}")
        )
    return multiplied(c, y, c.get_param(factor, "scale"), shape)


def _normalizes(c: Any, a: Any, r: RootMeanSquare) -> Walk | None:
    """What was read to find that a is the tensor r normalizes (the one r was taken of, or,
    for a variance of x, x minus its mean), with r's own; None where a is another tensor."""
    if not c.is_node(a):
        return None
    walk = Walk()
    if r.centered:
        x = _centered(c, a, r.dims, walk)
        same = x is not None and same_tensor(c, x, r.node, walk)
    else:
        same = same_tensor(c, a, r.node, walk)
    return r.walk.merged(walk) if same else None


ACTIVATION_FACTORS.append(_times_inverse_root)
ACTIVATION_DIVISORS.append(_over_root)
