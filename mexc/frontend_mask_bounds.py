"""How large the values of a mask read as a tensor can get: comparisons of activations and their
logical ops (0 and 1), masks of the token ids (frontend_key_masks), and what views, casts and
arithmetic with numbers make of them.

A mask grown beyond MAX_FILL in size (`(1 - keep) * -1e4`) is exact as a tensor of its own, but
a sum of it and an activation has one exponent, which its large values set: the activation's
mantissas round to 0 (`h + (1 - keep)[..., None] * -1e4` before a maximum, or such a mask added
to attention scores where mexc does not follow it to the softmax). Such a sum (and torch.where
choosing between the two) is refused by node. The forms mexc takes are converted before this
check: a mask of the ids added to scores before their softmax (frontend_key_masks), the fills of
torch.where and masked_fill (at most MAX_FILL).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from mexc.errors import UnsupportedOpError
from mexc.ops.attention import KeyMask
from mexc.ops.common import called_name, is_traced_tensor, static_value
from mexc.ops.tensor import MAX_FILL, is_boolean

# a mask seen another way keeps its values
_KEEPS = {
    "reshape",
    "view",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "permute",
    "transpose",
    "flatten",
    "contiguous",
    "clone",
    "detach",
    "float",
    "double",
    "half",
    "to",
    "type",
    "type_as",
    "getitem",
    "cat",
    "concat",
    "stack",
    "repeat",
    "tile",
}
# a mask and a number: the bound of the result from the mask's and the number's size
_WITH_NUMBER = {
    "mul": operator.mul,
    "truediv": operator.truediv,
    "div": operator.truediv,
    "true_divide": operator.truediv,
    "add": operator.add,
    "sub": operator.add,
    "rsub": operator.add,
}
# where a mask meets an activation in one sum
_SUMS = {"add", "sub", "rsub", "iadd", "isub", "where", "addcmul", "masked_fill", "add_", "sub_"}


def follow(c: Any, n: torch.fx.Node) -> None:
    """Record the bound of n's values where n is a mask (c.mask_bounds), or refuse n where it
    sums a mask beyond MAX_FILL with an activation. Called once n is converted."""
    if is_boolean(n):
        c.mask_bounds[n] = 1.0
        return
    operands = _tensor_operands(n)
    bounds = [_bound(c, a) for a in operands]
    known = [b for b in bounds if b is not None]
    if not known:
        return
    name = called_name(n)
    if name in _KEEPS and len(known) == len(bounds):
        c.mask_bounds[n] = max(known)
        return
    numbers = [v for v in _numbers(n) if isinstance(v, (int, float))]
    if name in _WITH_NUMBER and len(operands) == 1 and len(numbers) == 1:
        k = abs(float(numbers[0]))
        if name in ("truediv", "div", "true_divide") and k == 0:
            return
        c.mask_bounds[n] = _WITH_NUMBER[name](known[0], k)
        return
    if name == "neg" and len(operands) == 1:
        c.mask_bounds[n] = known[0]
        return
    if name in ("mul", "add", "sub") and len(known) == len(bounds) == 2:
        combine = operator.mul if name == "mul" else operator.add
        c.mask_bounds[n] = combine(known[0], known[1])
        return
    top = max(known)
    if name in _SUMS and len(known) < len(bounds) and top > MAX_FILL:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"adds a mask whose values can reach {top:g} in size to an activation; their sum "
                "has one exponent, which those values set, and the activation's entries would "
                "round to 0. Hide attention keys by adding the mask of the token ids to the "
                "scores before their softmax (at most -1e4 where hidden, 0 elsewhere), or keep "
                f"the mask's values within {MAX_FILL:g} (torch.where(mask, x, value))",
            )
        )


def _bound(c: Any, a: torch.fx.Node) -> float | None:
    held = c.env.get(a)
    if isinstance(held, KeyMask):
        return max(abs(held.on), abs(held.off))
    return c.mask_bounds.get(a)


def _tensor_operands(n: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    for a in [*n.args, *n.kwargs.values()]:
        items = a if isinstance(a, (list, tuple)) else [a]
        found += [i for i in items if isinstance(i, torch.fx.Node) and is_traced_tensor(i)]
    return found


def _numbers(n: torch.fx.Node) -> list[Any]:
    return [
        static_value(a)
        for a in [*n.args, *n.kwargs.values()]
        if not isinstance(a, (torch.fx.Node, list, tuple))
    ]
