"""torch.einsum and torch.matmul in general, as the ops mexc has.

A contraction of two activations is one batched `matmul`: each operand permuted to (shared
axes kept in the result, its own axes, the summed axes) and seen as [..., M, K] / [..., K, N],
the product seen back and permuted to the result's order. A contraction of an activation with a
parameter (or a buffer, a constant) is one `linear`, the parameter held as its [out, in]
weight: the summed axes are `in`, the parameter's own axes `out` (`x @ self.w`,
`torch.einsum("bnd,de->bne", x, w)`, `x @ rel_k.transpose(-1, -2)`). A parameter read
rearranged (transposed, permuted) is held in the rearranged order, so its weight gradient is
the linear layer's; mexc holds one copy of a parameter, so it is refused where another op reads
it in its declared layout. Products are exact int32 sums, compacted once, as in every
matmul and linear layer. Refused by node: a diagonal (a letter twice in one operand), a sum over
an axis of one operand alone, an axis of the batch contracted (a product of different samples),
more than two operands. A parameter that keeps one of the activation's axes in the result (a
weight per head) is read over the batch (gather_param) and multiplied as an activation.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mexc.arrangement import Arrangement, permutation
from mexc.errors import UnsupportedOpError
from mexc.ir import Op, Value
from mexc.ops.common import static_value
from mexc.ops.dense import linear
from mexc.ops.gather import Gathered, as_gathered, gathered_value
from mexc.ops.tensor import broadcast, repeats_whole_param, reshaped, summed_over, transposed

# letters standing for an ellipsis's axes (never valid in a torch equation)
_ELLIPSIS = tuple(chr(c) for c in range(0x3B1, 0x3C9))


@dataclass(frozen=True)
class _Operand:
    node: Any  # the fx node
    spec: str  # one letter per axis
    shape: tuple[int, ...]
    gathered: Gathered | None  # a parameter or constant (else an activation)
    value: Value | None = None  # an activation already converted (broadcast), else node's

    def activation(self, c: Any) -> Value:
        return self.value if self.value is not None else c.arg(self.node)


def einsum_convert(c: Any, n: Any) -> Value:
    """torch.einsum(equation, a[, b]) (operands as arguments or one list)."""
    eq, *args = n.args
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = list(args[0])
    eq = static_value(eq)
    if not isinstance(eq, str):
        raise UnsupportedOpError(c.describe(n, "takes an einsum equation that is not a string"))
    shapes = [tuple(c.shape(a)) for a in args]
    specs, out = _parse(c, n, eq, [len(s) for s in shapes])
    ops = [_Operand(a, s, sh, _as_weight(c, a)) for a, s, sh in zip(args, specs, shapes)]
    if len(ops) == 1:
        return _rearranged(c, n, ops[0], out)
    if len(ops) != 2:
        raise UnsupportedOpError(
            c.describe(n, f"contracts {len(ops)} operands; write it as einsums of two")
        )
    return contract(c, n, ops[0], ops[1], out)


def matmul_convert(c: Any, n: Any) -> Value:
    """a @ b, torch.matmul, torch.bmm: torch's broadcasting rules as a contraction (a 1-D
    operand gains and loses its axis; leading axes of size 1 broadcast: an activation's by
    copies, a parameter's dropped)."""
    a, b = n.args[0], n.args[1]
    sa, sb = tuple(c.shape(a)), tuple(c.shape(b))
    if not sa or not sb:
        raise UnsupportedOpError(c.describe(n, "multiplies by a scalar; write it as *"))
    lead_a, lead_b = sa[:-2], sb[:-2]
    rank = max(len(lead_a), len(lead_b))
    letters = _ELLIPSIS[:rank]
    spec_a = "".join(letters[rank - len(lead_a) :]) + ("m" if len(sa) > 1 else "") + "k"
    spec_b = "".join(letters[rank - len(lead_b) :]) + "k" + ("n" if len(sb) > 1 else "")
    out = "".join(letters) + ("m" if len(sa) > 1 else "") + ("n" if len(sb) > 1 else "")
    ops = [_Operand(x, s, sh, _as_weight(c, x)) for x, s, sh in ((a, spec_a, sa), (b, spec_b, sb))]
    sizes = _sizes(c, n, ops, broadcast_ones=True)
    ops = [_broadcast_leading(c, n, o, sizes, set(letters)) for o in ops]
    return contract(c, n, ops[0], ops[1], out)


def _as_weight(c: Any, a: Any) -> Gathered | None:
    """Operand a as a parameter or constant, None where it is an activation: a parameter
    repeated whole over the batch (DETR's `query_embed.weight.unsqueeze(0).repeat(B, 1, 1)`)
    is an activation of its own (EXPAND_PARAM: tensor.repeated_param)."""
    g = as_gathered(c, a)
    return None if repeats_whole_param(c, g) else g


def contract(c: Any, n: Any, a: _Operand, b: _Operand, out: str) -> Value:
    """The contraction of two operands to the result spec `out`."""
    if a.gathered is not None and b.gathered is not None:
        raise UnsupportedOpError(
            c.describe(
                n,
                "multiplies two parameters or constants with each other, a function of the "
                "parameters that mexc does not train; multiply an activation by each",
            )
        )
    for o in (a, b):
        _check_sums(c, n, o, (b if o is a else a).spec + out)
    if a.gathered is not None or b.gathered is not None:
        x, w = (b, a) if a.gathered is not None else (a, b)
        return _with_weight(c, n, x, w, out)
    return _product(c, n, a, b, out)


# ----------------------------------------------------------------------------- the two forms


def _product(c: Any, n: Any, a: _Operand, b: _Operand, out: str) -> Value:
    """Two activations: one batched matmul over the axes both keep."""
    sizes = _sizes(c, n, [a, b])
    kept = [x for x in out if x in a.spec and x in b.spec]
    summed = [x for x in a.spec if x in b.spec and x not in out]
    own_a = [x for x in out if x in a.spec and x not in b.spec]
    own_b = [x for x in out if x in b.spec and x not in a.spec]
    sample, other = _sample_letter(c, a), _sample_letter(c, b)
    sample = other if sample is None else sample
    if not kept or (sample is not None and sample not in kept) or other not in (None, sample):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"multiplies {a.spec} by {b.spec} across the batch axis (a product of "
                "different samples); mexc keeps the samples of a batch apart",
            )
        )
    if sample is not None:
        kept.remove(sample)
        kept.insert(0, sample)
    lead = tuple(sizes[x] for x in kept)
    m, k, nn = (math.prod(sizes[x] for x in part) for part in (own_a, summed, own_b))
    va = _arranged(c, a, kept + own_a + summed, (*lead, m, k))
    vb = _arranged(c, b, kept + summed + own_b, (*lead, k, nn))
    y = c.emit_as(Op.MATMUL, [va, vb], (*lead, m, nn))
    return _to_result(c, n, y, (*lead, m, nn), kept + own_a + own_b, out, sizes)


def _with_weight(c: Any, n: Any, x: _Operand, w: _Operand, out: str) -> Value:
    """An activation and a parameter (or constant): one linear layer, the parameter held as
    its [out, in] weight."""
    sizes = _sizes(c, n, [x, w])
    if any(s in x.spec and s in out for s in w.spec):
        return _per_group_weight(c, n, x, w, out)
    summed = [s for s in x.spec if s in w.spec]
    own_w = [s for s in out if s in w.spec]
    own_x = [s for s in out if s in x.spec]
    sample = _sample_letter(c, x)
    if sample is not None and sample not in own_x:
        raise UnsupportedOpError(
            c.describe(n, "contracts the batch axis with a parameter (a sum over samples)")
        )
    if sample is not None:
        own_x.remove(sample)
        own_x.insert(0, sample)
    rows = tuple(sizes[s] for s in own_x)
    k, m = math.prod(sizes[s] for s in summed), math.prod(sizes[s] for s in own_w)
    vx = _arranged(c, x, own_x + summed, (*rows, k))
    weight = _weight(c, n, w, own_w + summed, (m, k))
    y = linear(c, vx, weight, None, (*rows, m))
    return _to_result(c, n, y, (*rows, m), own_x + own_w, out, sizes)


def _per_group_weight(c: Any, n: Any, x: _Operand, w: _Operand, out: str) -> Value:
    """A parameter that keeps an axis of the activation's in the result (a weight per head,
    MViTv2's relative-position table per query row: "byhwc,hkc->byhwk"): the parameter read
    over the batch (a gather_param of (B, *its shape), period 1: every sample reads it whole),
    then the product of two activations. Its gradient is the matmul's, summed over the batch
    by the gather's."""
    sample = _sample_letter(c, x)
    if sample is None or sample in w.spec:
        raise UnsupportedOpError(
            c.describe(n, f"multiplies {x.spec} by a parameter {w.spec} per group of its axes")
        )
    g = w.gathered
    assert g is not None
    batch = x.shape[x.spec.index(sample)]
    wide = (batch, *w.shape)
    held = Gathered(g.source, np.asarray(g.index).reshape(w.shape), g.value)
    value = gathered_value(c, n, held, wide)
    return _product(c, n, x, _Operand(w.node, sample + w.spec, wide, None, value), out)


# ----------------------------------------------------------------------------- pieces


def _weight(c: Any, n: Any, w: _Operand, order: list[str], shape: tuple[int, int]) -> Value:
    """w's elements in `order` (its axes), seen as `shape`: a PARAM in that layout (a
    constant where w is a buffer or a tensor forward makes)."""
    g = w.gathered
    assert g is not None
    index = np.asarray(g.index).reshape(w.shape)
    index = index.transpose([w.spec.index(s) for s in order]).reshape(shape)
    if g.value is not None:  # a constant: its values, never trained
        name = getattr(g.source, "name", "constant")
        return c.constant(name, np.asarray(g.value).reshape(-1)[index], "weight")
    source = c.fetch(g.source)
    flat = source.detach().reshape(-1)
    whole = index.size == flat.numel() and bool(
        (np.bincount(index.reshape(-1), minlength=index.size) == 1).all()
    )  # every element read once: a permutation (linear time, a large weight's too)
    if not whole:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"multiplies by part of parameter '{g.source.target}' (indexed or sliced); "
                "mexc trains a weight a contraction reads whole: give the part its own "
                "parameter",
            )
        )
    order_key = hashlib.sha1(index.tobytes()).hexdigest()[:8]
    declared = tuple(source.shape) == shape and bool(
        (index.reshape(-1) == np.arange(index.size)).all()
    )
    transposed = (
        len(source.shape) == 2
        and tuple(source.shape)[::-1] == shape
        and bool((index.reshape(shape) == np.arange(index.size).reshape(source.shape).T).all())
    )
    # the layout names the order (two reads compare it); a transpose by that name alone
    layout = (
        ""
        if declared
        else f"transposed, as a [{shape[0]}, {shape[1]}] weight"
        if transposed
        else f"rearranged as a [{shape[0]}, {shape[1]}] weight (element order {order_key})"
    )
    arranged = None
    if not declared:  # an order no axis permutation gives is recorded as unknown (no split)
        arranged = permutation(tuple(source.shape), index) or Arrangement(
            tuple(source.shape), (), ()
        )
    held = flat[index.reshape(-1)].reshape(shape)
    return c.param(str(g.source.target), held, "weight", layout, n, arranged, tie=source)


def _arranged(c: Any, o: _Operand, order: list[str], shape: tuple[int, ...]) -> Value:
    """Activation o with its axes in `order`, seen as `shape`."""
    v = o.activation(c)
    perm = tuple(o.spec.index(s) for s in order)
    cur = o.shape
    if perm != tuple(range(len(perm))):
        v = transposed(c, v, cur, perm)
        cur = tuple(cur[p] for p in perm)
    return v if cur == shape else reshaped(c, v, shape)


def _to_result(
    c: Any,
    n: Any,
    y: Value,
    shape: tuple[int, ...],
    have: list[str],
    out: str,
    sizes: dict[str, int],
) -> Value:
    """y (of `shape`: the axes `have`, some merged) seen per axis and permuted to `out`, n's
    shape."""
    full = tuple(sizes[s] for s in have)
    y = reshaped(c, y, full) if shape != full else y
    perm = tuple(have.index(s) for s in out)
    if perm != tuple(range(len(perm))):
        y = transposed(c, y, full, perm)
    result = tuple(c.shape(n))
    final = tuple(sizes[s] for s in out)
    return reshaped(c, y, result) if final != result else y


def _sample_letter(c: Any, o: _Operand) -> str | None:
    """The letter of activation o's batch axis (None where mexc lost track of it)."""
    axis = c.batch_axis(o.activation(c))
    return None if axis is None else o.spec[axis]


def _check_sums(c: Any, n: Any, o: _Operand, elsewhere: str) -> None:
    for s in o.spec:
        if s not in elsewhere:
            raise UnsupportedOpError(
                c.describe(
                    n,
                    f"sums operand {o.spec} over its own axis '{s}' inside the contraction; "
                    "sum it first (x.sum(dim)) and contract the result",
                )
            )


def _sizes(c: Any, n: Any, ops: list[_Operand], broadcast_ones: bool = False) -> dict[str, int]:
    """Each letter's size (the larger where `broadcast_ones` and one operand has 1)."""
    sizes: dict[str, int] = {}
    for o in ops:
        for s, d in zip(o.spec, o.shape):
            have = sizes.setdefault(s, d)
            if have != d:
                if not (broadcast_ones and 1 in (have, d)):
                    raise UnsupportedOpError(
                        c.describe(n, f"contracts axis '{s}' of sizes {have} and {d}")
                    )
                sizes[s] = max(have, d)
    return sizes


def _broadcast_leading(
    c: Any, n: Any, o: _Operand, sizes: dict[str, int], leading: set[str]
) -> _Operand:
    """o with its leading axes of size 1 broadcast to `sizes`: an activation's repeated,
    a parameter's dropped (its index squeezed there)."""
    ones = [i for i, s in enumerate(o.spec) if s in leading and o.shape[i] == 1 != sizes[s]]
    if not ones:
        return o
    if o.gathered is not None:
        keep = [i for i in range(len(o.spec)) if i not in ones]
        index = np.asarray(o.gathered.index).reshape(o.shape).squeeze(tuple(ones))
        g = Gathered(o.gathered.source, index, o.gathered.value)
        spec = "".join(o.spec[i] for i in keep)
        return _Operand(o.node, spec, tuple(o.shape[i] for i in keep), g)
    wide = tuple(sizes[s] for s in o.spec)
    v = broadcast(c, n, o.activation(c), o.shape, wide)
    return _Operand(o.node, o.spec, wide, None, v)


def _rearranged(c: Any, n: Any, o: _Operand, out: str) -> Value:
    """A one-operand einsum: a permutation of its axes, after a sum over the axes the result
    drops ("bchw->bc"); _parse refused a diagonal (a letter repeated)."""
    if o.gathered is not None:
        raise UnsupportedOpError(c.describe(n, "rearranges a parameter alone with einsum"))
    dims = [i for i, s in enumerate(o.spec) if s not in out]
    if dims:
        kept = "".join(s for s in o.spec if s in out)
        shape = tuple(o.shape[i] for i, s in enumerate(o.spec) if s in out)
        y = summed_over(c, n, o.activation(c), o.shape, dims, shape)
        o = _Operand(o.node, kept, shape, None, y)
    return _arranged(c, o, list(out), tuple(c.shape(n)))


def _parse(c: Any, n: Any, eq: str, ranks: list[int]) -> tuple[list[str], str]:
    """The operands' specs and the result's, one letter per axis ("..." expanded)."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    parts = lhs.split(",")
    if len(parts) != len(ranks):
        raise UnsupportedOpError(
            c.describe(n, f"has an einsum equation for {len(parts)} operands, given {len(ranks)}")
        )
    spans = [r - (len(p) - 3) if "..." in p else 0 for p, r in zip(parts, ranks)]
    ell = "".join(_ELLIPSIS[: max(spans, default=0)])
    specs = [p.replace("...", ell[len(ell) - k :]) for p, k in zip(parts, spans)]
    for p, r in zip(specs, ranks):
        if len(p) != r or not all(ch.isalpha() for ch in p):
            raise UnsupportedOpError(c.describe(n, f"has einsum operand '{p}' for a {r}-D tensor"))
        if len(set(p)) != len(p):
            raise UnsupportedOpError(
                c.describe(n, f"takes a diagonal ('{p}' repeats a letter) with einsum")
            )
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(specs)
        out = ell + "".join(
            sorted(s for s in set(letters) if letters.count(s) == 1 and s not in ell)
        )
    return specs, out
