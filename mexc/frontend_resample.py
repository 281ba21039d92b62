"""Resampling that mexc has no op of its own for, as products with constant matrices.

mexc lowers nearest and bilinear resampling by integer factors with ops of their own
(`ops.pool.resampling_refusal` says which). Every other resampling torch offers that acts on
each spatial axis alone (bilinear with align_corners=True, as milesial's U-Net upsamples;
bicubic; ratios that are not whole, as a feature pyramid resizing 13 x 13 to 25 x 25; area and
antialiased resizing) is a linear map per axis: out = A_H x A_W^T for an (N, C, H, W) x. This
module rewrites the traced graph before conversion so that such a call is one
`torch.einsum` per changed axis with a constant matrix, a contraction mexc lowers as a linear
layer with a constant weight.

The matrices are torch's own: each is read off the call itself, applied on the host to the
one-hot basis of its axis (constant along the other axes, which every such mode keeps
constant), so the sizes, scale factors, align_corners and border rules are exactly torch's.
The product of the matrices is then checked against the call on a random input (float64);
a call that is not separable so is left to the converter, which refuses it by node.

The cost: a dense product per axis, in x out multiply-adds per column (a 2x upsampling of 64
rows: 8,192 per column, where bilinear's own op does a few), and each matrix is an int8
constant with one exponent, so a weight such as 1/3 is held to 7 significant bits.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from mexc.ops.common import STATIC_VALUE, static_value
from mexc.ops.pool import resampling_arguments, resampling_refusal

_FUNCTIONS = (F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear)
FACTOR_PREFIX = "_mexc_resample"  # the matrices' buffer names on the traced module
_TOLERANCE = 1e-9  # of the separable form against torch's call, relative, in float64


def resampling_as_products(gm: torch.fx.GraphModule) -> bool:
    """Rewrite each resampling of `gm` that mexc has no op for as products with constant
    matrices (module docstring). True where the graph changed."""
    changed = False
    for n in list(gm.graph.nodes):
        call = _call(gm, n)
        if call is None:
            continue
        x = n.args[0] if n.args else n.kwargs.get("input")
        sizes, out = _spatial(x), _spatial(n)
        if sizes is None or out is None or len(sizes) != len(out) or not 1 <= len(sizes) <= 3:
            continue
        module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        mode, corners, antialias, factor = resampling_arguments(n, module)
        if resampling_refusal(mode, sizes, out, corners, antialias, factor) is None:
            continue  # lowered by the resampling ops
        matrices = _matrices(call, sizes, out)
        if matrices is None:
            continue
        with gm.graph.inserting_before(n):
            y: Any = x
            for axis, a in enumerate(matrices):
                if a is None:
                    continue
                name = f"{FACTOR_PREFIX}_{n.name}_{axis}"
                gm.register_buffer(name, a.to(torch.float32), persistent=False)
                y = gm.graph.call_function(
                    torch.einsum, (_equation(len(sizes) + 2, axis + 2), y, gm.graph.get_attr(name))
                )
                y.meta["stack_trace"] = n.meta.get("stack_trace")
        n.replace_all_uses_with(y)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()
    return changed


def _call(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Callable[[torch.Tensor], Any] | None:
    """n's resampling as a function of its input alone, or None where n is no resampling (or
    one of arguments known only as the model runs)."""
    if n.op == "call_module":
        module = gm.get_submodule(str(n.target))
        return module if isinstance(module, nn.Upsample) else None
    if n.op != "call_function" or n.target not in _FUNCTIONS:
        return None
    options = {k: v for k, v in n.kwargs.items() if k != "input"}  # the input: t, below
    rest: list[Any] = []
    torch.fx.node.map_arg((n.args[1:], options), rest.append)
    if any(STATIC_VALUE not in a.meta for a in rest):
        return None  # a size read from another tensor's values
    args, kwargs = static_value(tuple(n.args[1:])), {k: static_value(v) for k, v in options.items()}
    target: Any = n.target
    return lambda t: target(t, *args, **kwargs)


def _spatial(n: Any) -> tuple[int, ...] | None:
    """The spatial sizes (the axes after N and C) of a traced float tensor."""
    meta = n.meta.get("tensor_meta") if isinstance(n, torch.fx.Node) else None
    if meta is None or not hasattr(meta, "shape") or not meta.dtype.is_floating_point:
        return None
    return tuple(int(d) for d in meta.shape[2:])


def _matrices(
    call: Callable[[torch.Tensor], Any], sizes: tuple[int, ...], out: tuple[int, ...]
) -> list[torch.Tensor | None] | None:
    """Per spatial axis, the [out, in] matrix the call applies along it (None where the axis is
    left as it is); None where the call is not a product of such maps."""
    matrices: list[torch.Tensor | None] = []
    with torch.no_grad():
        for axis, size in enumerate(sizes):
            # sample j: the one-hot j along the axis, constant along the others
            seen = [size, 1, *([1] * len(sizes))]
            seen[axis + 2] = size
            onehot = torch.eye(size, dtype=torch.float64).reshape(seen)
            got = call(onehot.expand(size, 1, *sizes).contiguous())
            if not isinstance(got, torch.Tensor) or tuple(got.shape[2:]) != out:
                return None
            index: list[Any] = [slice(None), 0] + [0] * len(sizes)
            index[axis + 2] = slice(None)
            a = got[tuple(index)].T.contiguous()  # [out, in]
            same = out[axis] == size and torch.equal(a, torch.eye(size, dtype=a.dtype))
            matrices.append(None if same else a)
        seed = torch.Generator().manual_seed(0)
        x = torch.randn((2, 3, *sizes), dtype=torch.float64, generator=seed)
        want = call(x)
        y = x
        for axis, m in enumerate(matrices):
            if m is not None:
                y = torch.einsum(_equation(len(sizes) + 2, axis + 2), y, m)
    if not isinstance(want, torch.Tensor) or want.shape != y.shape:
        return None
    scale = float(want.abs().max()) or 1.0
    return matrices if float((want - y).abs().max()) <= _TOLERANCE * scale else None


def _equation(rank: int, axis: int) -> str:
    """The einsum of a rank-`rank` tensor and an [out, in] matrix along `axis`."""
    letters = string.ascii_lowercase[:rank]
    upper = letters[axis].upper()
    return f"{letters},{upper}{letters[axis]}->{letters.replace(letters[axis], upper)}"
