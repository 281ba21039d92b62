"""Indexing an activation: reads (`x[...]`, getitem) and writes (`x[...] = v`, setitem).

A read is a SLICE per indexed axis (every_nth for a step), then a RESHAPE that drops the
integer-indexed axes. A write builds the written tensor from pieces: along each axis the key
restricts, the part before the region, the region (written recursively along the next axes)
and the part after, concatenated; the innermost region is the value, broadcast to it. The
program has no memory of its own for a tensor, so the write rebinds the written node to the new
value, which every later reader of the node sees. A write that another tensor would see
through a view (x.view(...)[...] = v with x read again) is refused by node.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.fx

from mexc.errors import UnsupportedOpError
from mexc.ir import Value
from mexc.ops import gather
from mexc.ops.common import called_name, is_traced_tensor, static_value
from mexc.ops.tensor import broadcast, concatenated, every_nth, reshaped, sliced

# Tensor methods and torch functions whose result may share memory with their input: a write
# into one is seen through the other
# fmt: off
_VIEWS = frozenset((
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "flatten", "unflatten",
    "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "chunk", "split", "tensor_split",
    "unbind", "t", "select", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims",
    "as_strided", "unfold", "contiguous", "detach", "real", "imag", "to", "float", "type_as",
    "type", "double", "half", "cpu", "cuda",
))
# modules that may return their input tensor, or a view of it (by class name: the frontend
# records it in the node's meta["mexc_module"])
_SAME_MODULES = frozenset((
    "Identity", "Flatten", "Unflatten", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
    "AlphaDropout", "FeatureAlphaDropout", "DropPath", "DropBlock2d",
))
# fmt: on


class _Range(NamedTuple):
    start: int
    stop: int
    step: int
    integer: bool  # the key holds an integer there: the axis is dropped from the read


def _ranges(
    c: Any, n: torch.fx.Node, key: Any, shape: tuple[int, ...], new_axes: bool = False
) -> list[_Range]:
    """The key as one range per axis of `shape` (integers, forward slices, one Ellipsis).
    new_axes: the key may hold None (an axis of extent 1 inserted there, as unsqueeze: the
    read's final reshape makes it), left out of the ranges."""
    items: list[Any] = list(key) if isinstance(key, tuple) else [key]
    if new_axes:
        items = [t for t in items if t is not None]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if (
        items.count(Ellipsis)
        or len(items) > len(shape)
        or any(
            isinstance(t, bool)
            or not isinstance(t, (int, slice))
            or (isinstance(t, slice) and not _forward(t.step))
            for t in items
        )
    ):
        allowed = "integers, forward slices, one Ellipsis" + (" and None" if new_axes else "")
        raise UnsupportedOpError(
            c.describe(
                n,
                f"indexes an activation with {repr(key)[:80]}; mexc takes {allowed} (not a "
                "tensor of indices, a boolean mask or a reversed slice)",
            )
        )
    items += [slice(None)] * (len(shape) - len(items))
    out = []
    for size, item in zip(shape, items):
        integer = isinstance(item, int)
        if integer and not -size <= item < size:
            raise UnsupportedOpError(c.describe(n, f"indexes {item} of an axis of size {size}"))
        start, stop, step = (slice(item % size, item % size + 1) if integer else item).indices(size)
        out.append(_Range(start, max(stop, start), step, integer))
    return out


def _forward(step: Any) -> bool:
    return step is None or (isinstance(step, int) and step > 0)


def _whole(r: _Range, size: int) -> bool:
    return (r.start, r.stop, r.step) == (0, size, 1)


def _refuse_batch(c: Any, n: torch.fx.Node, v: Value, dim: int, what: str) -> None:
    batch = c.batch_axis(v)
    if dim == batch or (dim == 0 and batch is None):
        raise UnsupportedOpError(c.describe(n, what))


def _listed(key: Any, rank: int) -> tuple[Any, int, list[int]] | None:
    """A key with one list of integers among slices, Ellipsis and None (CSATv2's
    `x[:, :, self.permutation]`): the key with the list read as a whole axis, the input axis
    it indexes, and the list. None for any other key (integers beside a list are torch's
    advanced indexing, which moves the axes: not taken)."""
    items = list(key) if isinstance(key, tuple) else [key]
    lists = [i for i, t in enumerate(items) if isinstance(t, list)]
    if len(lists) != 1 or any(isinstance(t, int) for t in items):
        return None
    at = lists[0]
    values = items[at]
    if not values or not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
        return None
    axes = [t for t in items if t is not None]  # the input axes the key names
    pos = next(i for i, t in enumerate(axes) if t is values)
    if Ellipsis in axes[:pos]:  # after an Ellipsis: counted from the end
        pos = rank - (len(axes) - pos)
    items[at] = slice(None)
    return tuple(items) if isinstance(key, tuple) else items[0], pos, list(values)


def _taken(c: Any, v: Value, shape: list[int], dim: int, index: list[int]) -> Value:
    """v's entries `index` along `dim` (each in [-size, size): torch ran the key on the
    example), in that order: the runs of consecutive entries sliced out and concatenated (exact
    copies; their gradients join back into one tensor, docs/layers.md "Gradient sums")."""
    at = [i % shape[dim] for i in index]
    runs: list[tuple[int, int]] = []
    for i in at:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    parts = [sliced(c, v, tuple(shape), dim, start, stop) for start, stop in runs]
    out = (*shape[:dim], len(at), *shape[dim + 1 :])
    return parts[0] if len(parts) == 1 else concatenated(c, parts, out, dim)


def read(c: Any, n: torch.fx.Node) -> Value:
    """x[...] with integers and unit-step or strided forward slices along non-batch axes
    (x[:, 0], x[:, 1:], x[:, ::2]), None for a new axis of extent 1 (x[:, :, None, None]),
    and one list of integers beside slices (x[:, :, [0, 1, 8]])."""
    x = n.args[0]
    shape = list(c.shape(x))
    v = c.arg(x)
    key = static_value(n.args[1])
    listed = _listed(key, len(shape))
    if listed is not None:
        key, axis, index = listed
        _refuse_batch(c, n, v, axis, "indexes the batch axis")
    for dim, r in enumerate(_ranges(c, n, key, tuple(shape), new_axes=True)):
        if _whole(r, shape[dim]):
            continue
        _refuse_batch(c, n, v, dim, "indexes the batch axis")
        if (r.start, r.stop) != (0, shape[dim]):
            v = sliced(c, v, tuple(shape), dim, r.start, r.stop)
            shape[dim] = r.stop - r.start
        if r.step > 1:
            v, taken = every_nth(c, v, tuple(shape), dim, r.step)
            shape = list(taken)
    if listed is not None:
        v = _taken(c, v, shape, axis, index)
        shape[axis] = len(index)
    out = c.shape(n)
    return reshaped(c, v, out) if tuple(shape) != tuple(out) else v


def write(c: Any, n: torch.fx.Node) -> None:
    """operator.setitem(x, key, value) into an activation x: x's node is bound to x with the
    region replaced (a value broadcast to it: an activation, a scalar, a parameter or a
    constant), along non-batch axes and unit-step slices."""
    x, key, value = n.args
    held = c.env.get(x) if isinstance(x, torch.fx.Node) else None
    if not isinstance(x, torch.fx.Node) or not isinstance(held, Value):
        raise UnsupportedOpError(
            c.describe(
                n,
                "writes into a parameter, a buffer or a constant the model computes from one; "
                "mexc writes only into activations",
            )
        )
    shape = tuple(c.shape(x))
    ranges = _ranges(c, n, static_value(key), shape)
    for dim, r in enumerate(ranges):
        if r.step != 1:
            raise UnsupportedOpError(c.describe(n, "writes through a strided slice"))
        if not _whole(r, shape[dim]):
            _refuse_batch(c, n, held, dim, "writes into part of the batch axis")
    _refuse_overlapping_copy(c, n, x, value, ranges)
    region = tuple(r.stop - r.start for r in ranges)
    if 0 in region:
        refuse_aliases(c, n, x)
        return  # an empty region: nothing is written
    new = _replaced(c, held, shape, ranges, _region_value(c, n, value, ranges, region), 0)
    rebind(c, n, x, new)


def rebind(c: Any, n: torch.fx.Node, x: torch.fx.Node, v: Any) -> None:
    """Node n changed x's tensor in place to v (a write, x.add_(y), a layer with
    inplace=True): every node naming that tensor (x, and the in-place ops' results on it) is
    bound to v (a Value, or the masked scores of x.masked_fill_), and n names it too. Refused
    where a view of the tensor would miss the change (refuse_aliases) or where v has another
    shape (x.unsqueeze_(1))."""
    if is_traced_tensor(n) and c.shape(n) != c.shape(x):
        raise UnsupportedOpError(
            c.describe(n, "changes the shape of its input in place; use the op without '_'")
        )
    refuse_aliases(c, n, x)
    c.names[n] = c.names[x] = c.names.get(x, x)
    for m in _names_of(c, x):
        c.env[m] = v
        c.rebound[m] = c.position.get(n, len(c.position))


def _names_of(c: Any, x: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes naming x's tensor: x, and the in-place ops' results on it (rebind)."""
    root = c.names.get(x, x)
    return {m for m, r in c.names.items() if r is root} | {x}


def _refuse_overlapping_copy(
    c: Any, n: torch.fx.Node, x: torch.fx.Node, value: Any, ranges: list[_Range]
) -> None:
    """A value read from the written tensor itself: torch copies it element by element in
    memory order, so where the read and the written regions overlap the result depends on
    that order. A read x[...] of disjoint elements is the old values (mexc's); an overlapping
    read, or one through another view, is refused."""
    if not isinstance(value, torch.fx.Node):
        return
    names = _names_of(c, x)
    source, chain = value, []
    while _is_view(source) and source.args and isinstance(source.args[0], torch.fx.Node):
        chain.append(source)
        source = source.args[0]
    if source not in names:
        return
    if len(chain) == 1 and chain[0].target is operator.getitem:
        read = _ranges(c, chain[0], static_value(chain[0].args[1]), tuple(c.shape(source)))
        if any(a.stop <= b.start or b.stop <= a.start for a, b in zip(read, ranges)):
            return  # disjoint along some axis
    raise UnsupportedOpError(
        c.describe(
            n,
            "writes into a tensor a value read from its own elements that overlap the written "
            "ones (or read through a view), whose result torch leaves to the copy's memory "
            "order; write a .clone() of the value",
        )
    )


def _region_value(
    c: Any, n: torch.fx.Node, value: Any, ranges: list[_Range], region: tuple[int, ...]
) -> Value:
    """The written value as a tensor of the region's shape (the integer-indexed axes kept as
    size 1), broadcast as torch broadcasts it to the indexed shape."""
    if not isinstance(value, torch.fx.Node):
        number = static_value(value)
        if not isinstance(number, (int, float)):
            raise UnsupportedOpError(c.describe(n, f"writes {value!r}, which is not a tensor"))
        filled = np.full(region, float(number), np.float32)
        return gather.gathered_value(c, n, gather.const_gathered(n, filled), region)
    indexed = tuple(size for size, r in zip(region, ranges) if not r.integer)
    g = gather.as_gathered(c, value) if not isinstance(c.env.get(value), Value) else None
    if g is not None:  # a parameter or constant written into the activation
        v = gather.gathered_value(c, n, g, indexed)
        return reshaped(c, v, region) if indexed != region else v
    v = c.arg(value)
    src = tuple(c.shape(value))
    if len(src) > len(indexed):
        raise UnsupportedOpError(
            c.describe(n, f"writes a value of shape {list(src)} into a region of {list(indexed)}")
        )
    padded = iter((1,) * (len(indexed) - len(src)) + src)
    full = tuple(1 if r.integer else next(padded) for r in ranges)
    if full != src:
        v = reshaped(c, v, full)
    if full == region:
        return v
    if not all(a in (1, b) for a, b in zip(full, region)) or full[0] != region[0]:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"writes a value of shape {list(src)} into a region of {list(indexed)}, which it "
                "does not broadcast to along its non-batch axes",
            )
        )
    return broadcast(c, n, v, full, region)


def _replaced(
    c: Any, v: Value, shape: tuple[int, ...], ranges: list[_Range], value: Value, dim: int
) -> Value:
    """v (of `shape`) with its region from axis `dim` on replaced by `value`."""
    while dim < len(shape) and _whole(ranges[dim], shape[dim]):
        dim += 1
    if dim == len(shape):
        return value
    start, stop = ranges[dim].start, ranges[dim].stop
    inner = (*shape[:dim], stop - start, *shape[dim + 1 :])
    mid = _replaced(c, sliced(c, v, shape, dim, start, stop), inner, ranges, value, dim + 1)
    parts = []
    if start > 0:
        parts.append(sliced(c, v, shape, dim, 0, start))
    parts.append(mid)
    if stop < shape[dim]:
        parts.append(sliced(c, v, shape, dim, stop, shape[dim]))
    return concatenated(c, parts, shape, dim) if len(parts) > 1 else mid


def _is_view(m: torch.fx.Node) -> bool:
    """m's result may share memory with its first argument: a view, a cast to the same dtype
    (x.float(), x.to(...), x.type_as(y)), a module that returns its input (nn.Identity,
    dropout in evaluation, nn.Flatten's view)."""
    if m.op == "call_module":
        return str(m.meta.get("mexc_module", "")) in _SAME_MODULES
    if m.op not in ("call_method", "call_function"):
        return False
    if m.target is operator.getitem:
        return True
    return called_name(m) in _VIEWS


def refuse_aliases(c: Any, n: torch.fx.Node, x: torch.fx.Node) -> None:
    """A write into x (by node n) that another node would see through shared memory (x a view of a
    tensor read after the write, or a view of x taken before it and read after) is refused:
    mexc's tensors share no memory, so that reader would miss the write."""
    order = {m: i for i, m in enumerate(n.graph.nodes)}
    names = _names_of(c, x)  # rebound together
    aliases, todo = set(names), list(names)
    while todo:
        m = todo.pop()
        # views taken before the write (one taken after it reads the new value)
        near = [u for u in m.users if _is_view(u) and order[u] < order[n]]
        if _is_view(m) and m.args and isinstance(m.args[0], torch.fx.Node):
            near.append(m.args[0])
        for a in near:
            if a not in aliases:
                aliases.add(a)
                todo.append(a)
    for a in aliases - names:
        late = [u for u in a.users if u not in aliases and order[u] > order[n]]
        if late:
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"writes into a tensor that shares memory with '{a.name}', which "
                    f"'{late[0].name}' reads after the write; mexc's tensors share no memory, "
                    "so write into the tensor that is read, or build the result with torch.cat",
                )
            )
