"""Attention ops: softmax over the last axis and batched matmul, and their gradients."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.kernels.transformer import KEY_CMP_NEGATED, causal_hidden, key_hidden
from mexc.ops.activation import selected, where_selected
from mexc.ops.common import (
    IN_EVAL_MODE,
    Grads,
    before_last,
    elementwise_types,
    pointwise_vjp,
    static_int,
    static_value,
    tid,
)
from mexc.ops.contraction import einsum_convert, matmul_convert
from mexc.ops.dense import CAP, linear
from mexc.ops.gather import static_tensor
from mexc.ops.registry import OpDef, Pattern, define
from mexc.ops.tensor import (
    MAX_FILL,
    broadcast,
    broadcastable,
    folded_value,
    is_fill,
    reshaped,
    scaled,
    sliced,
    transposed,
)
from mexc.types import mx


def _matmul_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    a, b = n.inputs
    node = w.emit(Op.MATMUL_GRAD, [dy, a, b], (mx(*w.type(a).shape), mx(*w.type(b).shape)), n.loc)
    return [node.result(0) if w.needs[a] else None, node.result(1) if w.needs[b] else None]


def _matmul_k(n: Node, t: Any) -> int:
    return int(t(0).shape[-1])  # a[..., M, K] @ b[..., K, N]


def _matmul_grad_k(n: Node, t: Any) -> int:
    dy = t(0).shape  # da = dy @ b^T reduces over N; db = a^T @ dy over M
    return int(max(dy[-1], dy[-2]))


def _softmax(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    cmp = str(n.attrs.key_cmp)
    keys = key_hidden(a[1], cmp, int(n.attrs.key_value)) if cmp else None
    return (K.softmax_forward(a[0], env.ctx, tid(n), bool(n.attrs.causal), keys),)


def _softmax_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """The softmax's gradient (p = 0 at hidden keys gives them dx = 0); the token ids that a
    key mask reads have none."""
    return [*_softmax_rule(w, n, dys), *([None] * (len(n.inputs) - 1))]


_softmax_rule = pointwise_vjp(Op.SOFTMAX_GRAD, lambda n: n.out)


def _softmax_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.softmax_backward(a[0], a[1], env.ctx, tid(n)),)


def _matmul(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.matmul_forward(a[0], a[1], env.ctx, tid(n)),)


def _matmul_grad(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return tuple(K.matmul_backward(a[0], a[1], a[2], env.ctx, tid(n)))


def _softmax_convert(c: Any, n: Any) -> Value:
    """softmax over the last axis, or over another non-batch axis (ResNeSt's split attention,
    CoaT) with that axis swapped to the end and back."""
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    dtype = n.kwargs.get("dtype", n.args[2] if len(n.args) > 2 else None)
    if dtype is not None and not getattr(dtype, "is_floating_point", False):
        raise UnsupportedOpError(c.describe(n, f"takes a softmax in {dtype}"))
    return _softmax_over(c, n, dim)  # a float dtype: mexc's probabilities are its own


def _softmax_module(c: Any, n: Any, m: Any) -> Value:
    """nn.Softmax(dim) (timm's Swin); nn.Softmax2d, over the channels (axis -3)."""
    return _softmax_over(c, n, m.dim if hasattr(m, "dim") else -3)  # Softmax2d has no dim


def _log_softmax(c: Any, n: Any, m: Any = None) -> Value:
    """log_softmax over the classes as the model's output (the classic `return
    F.log_softmax(x, dim=1)` trained with NLLLoss): the logits themselves. The loss head
    applies log-softmax, and log_softmax(x) = x - logsumexp(x) differs from x by one number per
    row, which changes neither the cross-entropy nor the prediction; the program's logits are
    the model's output up to that number. Elsewhere it is refused."""
    x = n.args[0]
    dim = (
        m.dim
        if m is not None
        else static_value(n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None))
    )
    shape = tuple(c.shape(x))
    if dim is None:  # torch's implicit dim (deprecated, with a warning): 1 for 2-D logits
        dim = 0 if len(shape) in (0, 1, 3) else 1
    last = len(shape) == 2 and int(dim) % 2 == 1
    if not (last and n.users and all(u.op == "output" for u in n.users)):
        raise UnsupportedOpError(
            c.describe(
                n,
                "takes log_softmax other than over the classes of the model's output; mexc "
                "applies log-softmax in its loss head, so return the logits (or their "
                "log_softmax) from forward",
            )
        )
    return c.arg(x)


def _softmin(c: Any, n: Any, m: Any = None) -> Value:
    """nn.Softmin(dim), F.softmin(x, dim): the softmax of -x (`scale` by -1)."""
    args = dict(zip(("input", "dim"), n.args)) | dict(n.kwargs)
    if args.get("dtype") is not None:
        raise UnsupportedOpError(c.describe(n, "takes a softmin with a dtype"))
    x = args["input"]
    negated = scaled(c, c.arg(x), tuple(c.shape(x)), -1.0)
    return _softmax_over(c, n, m.dim if m is not None else args.get("dim"), negated)


def _softmax_over(c: Any, n: Any, dim: Any, v: Value | None = None) -> Value:
    """The softmax of n's input (or of `v`, a value of its shape) over axis `dim`."""
    shape = tuple(c.shape(n.args[0]))
    rank = len(shape)
    if dim is None:
        raise UnsupportedOpError(c.describe(n, "takes a softmax without a dim; name the axis"))
    d = static_int(dim) % rank
    held = c.env.get(n.args[0]) if c.is_node(n.args[0]) else None
    if isinstance(held, MaskedScores) and v is None:
        if d != rank - 1:
            raise UnsupportedOpError(c.describe(n, f"{MASKED_READ}, not over axis {d}"))
        inputs, hides = _hiding(c, held.scores, held.causal, held.keys)
        return c.emit(Op.SOFTMAX, inputs, n, **hides)
    x = c.arg(n.args[0]) if v is None else v
    if d == rank - 1:
        return c.emit(Op.SOFTMAX, [x], n)
    if d == c.first_or_batch_axis(x):
        raise UnsupportedOpError(c.describe(n, "takes a softmax over the batch axis"))
    perm = list(range(rank))
    perm[d], perm[-1] = perm[-1], perm[d]
    moved = transposed(c, x, shape, tuple(perm))
    swapped = tuple(shape[a] for a in perm)
    y = c.emit_as(Op.SOFTMAX, [moved], swapped)
    return c.emit(Op.TRANSPOSE, [y], n, perm=tuple(perm))


# ----------------------------------------------------------------------------- attention


def _attention(
    c: Any,
    n: Any,
    q: Value,
    k: Value,
    v: Value,
    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    scale: float,
    dropout: float,
    mask: Value | None = None,
    causal: bool = False,
    keys: tuple[str, int] | None = None,
) -> Value:
    """softmax(q k^T scale + mask) v for q [..., Tq, d], k [..., Tk, d], v [..., Tk, dv] (the
    ops examples/vit.py writes by hand; Tk < Tq in spatial-reduction attention, PVT and Twins):
    a transpose, two matmuls, a scale, the additive mask of the scores' shape if any (a
    relative-position bias), a softmax (`causal`: each query's later keys hidden; `keys`: the
    keys whose token id makes (cmp, value) hold hidden, a padding mask) and, in training,
    dropout on the weights."""
    (*lead, tq, d), (_, tk, _), (_, dv) = shapes[0], shapes[1][-3:], shapes[2][-2:]
    axes = {c.batch_axis(x) for x in (q, k, v)} - {None}
    if len(axes) > 1 or any(a >= len(lead) for a in axes):
        raise UnsupportedOpError(
            c.describe(
                n,
                "attends across the batch axis (its tokens are different samples: a layer "
                "with batch_first=False given (N, T, D), or the reverse); mexc keeps the "
                "samples of a batch apart, so give each layer its batch where it expects it",
            )
        )
    if keys is not None and axes - {0}:
        raise UnsupportedOpError(
            c.describe(n, "hides keys by a mask of the token ids where the batch is not axis 0")
        )
    s = (*lead, tq, tk)
    rank = len(shapes[0])
    perm = (*range(rank - 2), rank - 1, rank - 2)
    kt = c.emit_as(Op.TRANSPOSE, [k], (*lead, d, tk), perm=perm)
    scores = c.emit_as(Op.SCALE, [c.emit_as(Op.MATMUL, [q, kt], s)], s, value=scale)
    if mask is not None:
        scores = c.emit_as(Op.ADD, [scores, mask], s)
    inputs, hides = _hiding(c, scores, causal, keys)
    p = c.emit_as(Op.SOFTMAX, inputs, s, **hides)
    if dropout > 0.0:
        p = c.emit_as(Op.DROPOUT, [p], s, p=dropout)
    return c.emit_as(Op.MATMUL, [p, v], (*lead, tq, dv))


def _hiding(
    c: Any, scores: Value, causal: bool, keys: tuple[str, int] | None
) -> tuple[list[Value], dict[str, Any]]:
    """The inputs and attributes of a softmax over `scores` that hides each query's later keys
    (`causal`) and the keys whose token id makes (cmp, value) hold (`keys`: it reads the ids)."""
    if keys is None:
        return [scores], {"causal": causal}
    cmp, value = keys
    return [scores, c.ids], {"causal": causal, "key_cmp": cmp, "key_value": value}


def _sdpa(c: Any, n: Any) -> Value:
    """F.scaled_dot_product_attention(q, k, v) (timm's fused attention), causal (is_causal, or
    a mask that hides each query's later keys) or with a finite float mask added to the
    scores. Its dropout_p is the traced one: models pass 0 outside training, and mexc traces
    in eval."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    qs, ks, vs = (tuple(c.shape(args[a])) for a in ("query", "key", "value"))
    q = c.arg(args["query"])
    gqa = bool(static_value(args.get("enable_gqa", False)))
    (k, ks), (v, vs) = (_over_query_heads(c, n, args[a], qs, gqa) for a in ("key", "value"))
    if ks[-1] != qs[-1] or vs[-2] != ks[-2]:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"attends with q {list(qs)}, k {list(ks)}, v {list(vs)}: q and k "
                "need one feature size, k and v one number of tokens",
            )  # fmt: skip
        )
    scale = static_value(args.get("scale")) or 1.0 / math.sqrt(qs[-1])
    dropout = float(args.get("dropout_p") or 0.0)
    scores = (*qs[:-1], ks[-2])
    m = args.get("attn_mask")
    keys = key_mask(c, n, m, scores, hides=False)
    if keys is not None:
        causal = bool(args.get("is_causal"))
        return _attention(c, n, q, k, v, (qs, ks, vs), float(scale), dropout, None, causal, keys)
    causal = bool(args.get("is_causal")) or is_causal_mask(c, n, m, scores, hides=False)
    mask = None if causal else _additive_mask(c, n, m, scores)
    return _attention(c, n, q, k, v, (qs, ks, vs), float(scale), dropout, mask, causal)


def _over_query_heads(
    c: Any, n: Any, x: Any, qs: tuple[int, ...], gqa: bool
) -> tuple[Value, tuple[int, ...]]:
    """SDPA's key or value x with q's leading (batch, head) axes: as it is where they are
    equal; broadcast where its axes are 1 there (multi-query attention: one key head for
    every query head, MobileNetV4's hybrid blocks); with enable_gqa, each of its H_k heads
    repeated for H_q / H_k consecutive query heads, as torch does (a reshape adding an axis,
    the broadcast, a reshape). The broadcast's gradient sums the copies."""
    xs, lead = tuple(c.shape(x)), qs[:-2]
    v = c.arg(x)
    if len(xs) == len(qs) >= 3 and xs[:-2] == lead:
        return v, xs
    wide = (*lead, *xs[-2:])
    if len(xs) == len(qs) >= 4 and gqa and xs[:-3] == qs[:-3] and qs[-3] % xs[-3] == 0:
        group = (*xs[:-2], 1, *xs[-2:])
        rows = (*xs[:-2], qs[-3] // xs[-3], *xs[-2:])
        spread = broadcast(c, n, reshaped(c, v, group), group, rows)
        return reshaped(c, spread, wide), wide
    if len(xs) == len(qs) >= 3 and not gqa and broadcastable(xs, wide):
        return broadcast(c, n, v, xs, wide), wide
    raise UnsupportedOpError(
        c.describe(
            n,
            f"attends with q {list(qs)} and k or v {list(xs)}: their leading (batch, head) "
            "axes differ other than by heads of 1 (multi-query) or, with enable_gqa, by a "
            "whole number of query heads per key head",
        )
    )


@dataclass(frozen=True)
class KeyMask:
    """A mask the forward computes from the token ids: `ids cmp value` (`ids == pad`), viewed
    as `shape` (the ids' elements in their order, axes of extent 1 inserted or removed, or
    broadcast by expand). A boolean one, or a float one holding `on` where the comparison holds
    and `off` elsewhere (`(1.0 - mask.float()) * -10000.0`, Hugging Face's additive mask).
    Attention reads it as its key mask; other ops as a tensor (mexc.frontend_key_masks)."""

    cmp: str
    value: int
    shape: tuple[int, ...]
    ids: tuple[int, ...]  # the ids' shape
    expanded: bool = False  # broadcast by expand
    boolean: bool = True
    on: float = 1.0
    off: float = 0.0

    def negated(self) -> KeyMask:
        return dataclasses.replace(self, cmp=KEY_CMP_NEGATED[self.cmp])

    def hiding(self) -> bool | None:
        """For a float mask added to attention scores: True where it hides the keys where the
        comparison holds (`on` at most HIDING, `off` 0), False where it hides the others, None
        where it hides none, or not in that form."""
        if self.boolean:
            return None
        if self.on <= HIDING and self.off == 0:
            return True
        if self.off <= HIDING and self.on == 0:
            return False
        return None


# what a key mask computed from the ids may be read by, for the refusals
KEY_MASK_USES = (
    "an attention reads a mask computed from the token ids as its key mask: "
    "nn.MultiheadAttention's key_padding_mask (the transformer layers' src_key_padding_mask), "
    "a boolean attn_mask of F.scaled_dot_product_attention shaped [N, 1, ..., 1, T] (True "
    "where a key takes part), or a masked_fill(mask, float('-inf')) of the attention scores"
)


def key_mask(
    c: Any, n: Any, m: Any, scores: tuple[int, ...], hides: bool
) -> tuple[str, int] | None:
    """(cmp, value) hiding the keys that mask m hides, where m is a KeyMask of the token ids
    broadcast over scores (N, ..., Tq, Tk) along its batch and key axes; None where m is not
    one. A boolean m's True hides its key (`hides`, key_padding_mask's convention) or lets it
    take part (a boolean attn_mask's); a float m, added to the scores, hides where it holds at
    most HIDING (KeyMask.hiding; None where it hides no key)."""
    mask = c.env.get(m) if c.is_node(m) else None
    if not isinstance(mask, KeyMask):
        return None
    if not mask.boolean:  # added to the scores: its values say which keys it hides
        hiding = mask.hiding()
        if hiding is None:
            return None
        hides = hiding
    ids = mask.ids
    along = (
        len(ids) == 2
        and len(mask.shape) == len(scores)
        and mask.shape[-1] == scores[-1] == ids[1]
        and mask.shape[0] == scores[0] == ids[0]
        and all(d == 1 for d in mask.shape[1:-1])
    )
    if not along or c.batch_axis(c.ids) != 0:
        raise UnsupportedOpError(
            c.describe(
                n,
                f"hides keys by a mask {list(mask.shape)} of the token ids {list(ids)} for "
                f"scores {list(scores)}; {KEY_MASK_USES}, the ids [N, T] with T the keys",
            )
        )
    return (mask.cmp, mask.value) if hides else (KEY_CMP_NEGATED[mask.cmp], mask.value)


# a float mask entry at or below this hides its key (torch's masks use -inf; others -1e9 or the
# dtype's minimum): exp of it is 0 in float32
HIDING = -1e4


def is_causal_mask(c: Any, n: Any, m: Any, scores: tuple[int, ...], hides: bool) -> bool:
    """Whether attention mask m (a buffer, or a constant the forward builds) hides exactly
    each query's later keys: the causal mask of scores (..., Tq, Tk). Boolean: True where a
    key is hidden (`hides`, nn.MultiheadAttention's) or where it takes part (F.scaled_dot_
    product_attention's); float: 0 where it takes part and -inf (or at most HIDING) where
    hidden. Any other mask with hidden keys is refused by node (_MASKS)."""
    values = None if m is None else static_tensor(c, m)
    if values is None:
        return False
    fits = values.ndim >= 2 and values.shape[-2:] == tuple(scores[-2:])
    hidden = causal_hidden(values.shape if fits else (0, 0))  # unread where it does not fit
    if values.dtype == np.bool_:
        if fits and bool(np.all(values == (hidden if hides else ~hidden))):
            return True
        raise UnsupportedOpError(c.describe(n, _MASKS))
    taken = values <= HIDING
    if not taken.any() and np.isfinite(values).all():
        return False  # a finite mask: added to the scores
    if fits and bool(np.all(taken == hidden)) and bool(np.all(values[..., ~hidden] == 0)):
        return True
    raise UnsupportedOpError(c.describe(n, _MASKS))


def _additive_mask(c: Any, n: Any, m: Any, scores: tuple[int, ...]) -> Value | None:
    """SDPA's float attn_mask, added to the scores: a parameter or buffer read through
    indexing (a relative-position bias, a window mask), or an activation that broadcasts to
    the scores. A boolean mask is refused; a fixed one with -inf entries was (is_causal_mask)."""
    if m is None:
        return None
    meta = m.meta.get("tensor_meta") if c.is_node(m) else None
    if meta is None or not getattr(getattr(meta, "dtype", None), "is_floating_point", False):
        raise UnsupportedOpError(
            c.describe(n, "uses a boolean or non-tensor attention mask; give a float mask")
        )
    held = folded_value(c, n, m, scores)
    if held is not None:
        return held
    shape = tuple(c.shape(m))
    if not broadcastable(shape, scores):
        raise UnsupportedOpError(
            c.describe(n, f"adds an attention mask {list(shape)} to scores {list(scores)}")
        )
    return broadcast(c, n, c.arg(m), shape, scores)


@dataclass(frozen=True)
class MaskedScores:
    """Attention scores whose hidden keys a masked_fill set to -inf or to a number at most
    HIDING (nanoGPT's causal `att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))`,
    or a padding mask of the ids), or that a float mask of the ids was added to: no int8
    mantissa holds -inf (nor -1e9 beside the scores), so the softmax over the last axis that
    reads them hides those keys itself (its `causal` and key mask), and nothing else may read
    them. A row whose every key is hidden (a sample of padding only) gets probabilities 0."""

    scores: Value
    causal: bool = False
    keys: tuple[str, int] | None = None


MASKED_READ = (
    "reads attention scores whose keys a mask hides (a masked_fill with -inf or -1e9, or an "
    "added mask of the token ids); mexc reads them only through a softmax over the last axis, "
    "which hides those keys itself"
)


def _masked_fill(c: Any, n: Any) -> MaskedScores | Value:
    """x.masked_fill(mask, -inf) (torch.masked_fill, x.masked_fill_; or a number at most
    HIDING: the Annotated Transformer's -1e9) on attention scores before their softmax: the
    mask is the causal one (a buffer, or a constant the forward builds: True above the
    diagonal) or a KeyMask of the token ids broadcast over the scores' batch and key axes.
    With a number of at most MAX_FILL in size and a boolean mask (`h.masked_fill(ids == pad,
    0.0)` before pooling), torch.where(mask, value, x). Other fills and masks are refused by
    node."""
    names = ("input", "mask", "value")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    return _masked(c, n, args["input"], args.get("mask"), static_value(args.get("value")))


def _where_convert(c: Any, n: Any) -> MaskedScores | Value:
    """torch.where(mask, fill, x) with fill -inf or a number at most HIDING (also a constant
    tensor of one such value: torch.full_like(scores, float("-inf"))) is
    x.masked_fill(mask, fill) (_masked_fill); torch.where(mask, x, fill) and x.where(mask,
    fill), which keep x where the mask holds (Hugging Face GPT-2's `torch.where(causal, w,
    finfo.min)`), are x.masked_fill(~mask, fill). Any other torch.where is
    activation.where_selected's."""
    first = (
        ("condition", "input", "other")
        if n.op == "call_function"
        else ("input", "condition", "other")
    )
    args = dict(zip(first, n.args)) | dict(n.kwargs)
    x, fill = args.get("other"), _hiding_fill(c, args.get("input"))
    if n.op == "call_function" and fill is not None and c.is_node(x):
        return _masked(c, n, x, args["condition"], fill)
    x, fill, kept = args.get("input"), _hiding_fill(c, args.get("other")), args.get("condition")
    if fill is not None and c.is_node(x) and _attention_mask(c, kept):
        return _masked(c, n, x, kept, fill, hides=False)
    return where_selected(c, n)


def _attention_mask(c: Any, m: Any) -> bool:
    """m may be an attention mask: a constant (a causal buffer, a mask the forward builds) or
    a mask of the token ids; not one computed from activations (`torch.where(h > 0, h,
    -1e4)` is no attention)."""
    return c.is_node(m) and (isinstance(c.env.get(m), KeyMask) or static_tensor(c, m) is not None)


def _hiding_fill(c: Any, v: Any) -> float | None:
    """v's value where it is one number at most HIDING (float('-inf'), -1e9), or a constant
    tensor of that one number; None otherwise."""
    if c.is_node(v):
        values = static_tensor(c, v)
        if values is None or values.dtype.kind != "f" or not values.size:
            return None
        first = float(values.flat[0])
        return first if first <= HIDING and bool((values == first).all()) else None
    value = static_value(v)
    return float(value) if _hides(value) else None


def _hides(fill: Any) -> bool:
    """fill is a number (not a bool) at most HIDING: a fill that hides scores from a softmax."""
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= HIDING


def _masked(c: Any, n: Any, x: Any, m: Any, fill: Any, hides: bool = True) -> MaskedScores | Value:
    """_masked_fill of x, the mask m and the fill (a number); hides=False: the fill goes where
    boolean m is False (torch.where(m, x, fill))."""
    held = c.env.get(x) if c.is_node(x) else None
    if hides and is_fill(fill) and not isinstance(held, MaskedScores):
        return selected(c, n, m, fill, x)
    if not _hides(fill):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"fills with {fill!r}; mexc takes masked_fill to hide attention scores from "
                f"their softmax, with float('-inf') or a number at most {HIDING:g}, or with a "
                f"number of at most {MAX_FILL:g} in size (a larger one would take the result's "
                "one exponent from the values)",
            )
        )
    base = held if isinstance(held, MaskedScores) else MaskedScores(c.arg(x))
    if c.batch_axis(base.scores) not in (0, None):
        raise UnsupportedOpError(c.describe(n, "masks scores whose batch axis is not the first"))
    shape = tuple(c.shape(x))
    keys = key_mask(c, n, m, shape, hides=hides)
    if keys is not None:
        if base.keys not in (None, keys):
            raise UnsupportedOpError(c.describe(n, "hides keys by a second mask of the ids"))
        return dataclasses.replace(base, keys=keys)
    if not is_causal_mask(c, n, m, shape, hides=hides):
        raise UnsupportedOpError(c.describe(n, _MASKS))
    return dataclasses.replace(base, causal=True)


def _mha_module(c: Any, n: Any, m: Any) -> tuple[Value, None]:
    """nn.MultiheadAttention as its ops: the input projections (LINEAR of
    in_proj_weight), the heads split by slices and transposes, the attention, the heads merged,
    the output projection. Results: (output, None), the attention weights are not computed
    (need_weights=False; a model that reads them is refused where it does).

    Self-attention (query, key and value one tensor) projects once, as torch's fused
    projection. Otherwise (a decoder's cross-attention over its memory) each distinct input is
    projected by the whole in_proj_weight and the rows it needs are sliced out: mexc holds a
    parameter once and reads a layer's weight as declared, so this costs the unused rows'
    products (3x the query's projection, 1.5x the memory's) for an unchanged gradient (the
    unused rows' is zero). batch_first=False: the (T, N, D) inputs are transposed to
    (N, T, D) and the output back. Masks: attn_mask the causal one, key_padding_mask [N, S] a
    KeyMask of the token ids (True where a key is hidden), either or both."""
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    args = dict(zip(names, n.args)) | dict(n.kwargs)
    padding = args.get("key_padding_mask")
    if not m._qkv_same_embed_dim:
        raise UnsupportedOpError(
            c.describe(
                n,
                "has kdim or vdim other than embed_dim (separate projections); project the "
                "keys and values to embed_dim with nn.Linear layers first",
            )
        )
    if m.bias_k is not None or m.add_zero_attn:
        raise UnsupportedOpError(c.describe(n, "uses add_bias_kv or add_zero_attn"))
    d, h = int(m.embed_dim), int(m.num_heads)
    name = str(n.target)
    weight = c.param(f"{name}.in_proj_weight", m.in_proj_weight, "weight")
    bias = m.in_proj_bias
    bv = c.param(f"{name}.in_proj_bias", bias, "bias") if bias is not None else None
    inputs = [args[a] for a in ("query", "key", "value")]
    shapes = [tuple(c.shape(a)) for a in inputs]
    if any(len(s) != 3 or s[-1] != d for s in shapes):
        raise UnsupportedOpError(
            c.describe(
                n,
                f"attends over {[list(s) for s in shapes]}; mexc takes batched 3-D "
                f"inputs with {d} features",
            )
        )
    seq_first = not m.batch_first
    if seq_first:  # (T, N, D) -> (N, T, D)
        shapes = [(s[1], s[0], s[2]) for s in shapes]
    (b, t, _), (bk, s, _), (bv_, sv, _) = shapes
    if not (b == bk == bv_ and s == sv):
        raise UnsupportedOpError(
            c.describe(
                n,
                "takes query, key and value of different batches, or key and value "
                "of different lengths",
            )
        )
    projected: dict[Any, Value] = {}
    heads = []
    for i, a in enumerate(inputs):
        if a not in projected:
            x = c.arg(a)
            if seq_first:
                x = transposed(c, x, (shapes[i][1], shapes[i][0], d), (1, 0, 2))
            projected[a] = linear(c, x, weight, bv, (b, shapes[i][1], 3 * d))
        tokens = shapes[i][1]
        part = sliced(c, projected[a], (b, tokens, 3 * d), 2, i * d, (i + 1) * d)
        split = reshaped(c, part, (b, tokens, h, d // h))
        heads.append(transposed(c, split, (b, tokens, h, d // h), (0, 2, 1, 3)))
    q, k, v = heads
    hs = ((b, h, t, d // h), (b, h, s, d // h), (b, h, s, d // h))
    keys = None
    if padding is not None:
        keys = key_mask(c, n, padding, (b, s), hides=True)
        if keys is None:
            raise UnsupportedOpError(c.describe(n, _MASKS))
    mask = args.get("attn_mask")
    causal = is_causal_mask(c, n, mask, (b, h, t, s), hides=True)
    # is_causal is torch's hint that attn_mask is causal: without such a mask, refused too
    if (mask is not None or args.get("is_causal")) and not causal:
        raise UnsupportedOpError(c.describe(n, _MASKS))
    scale, dropout = 1.0 / math.sqrt(d // h), 0.0 if n.meta.get(IN_EVAL_MODE) else float(m.dropout)
    y = _attention(c, n, q, k, v, hs, scale, dropout, None, causal, keys)
    merged = reshaped(c, transposed(c, y, (b, h, t, d // h), (0, 2, 1, 3)), (b, t, d))
    out = m.out_proj
    weight = c.param(f"{name}.out_proj.weight", out.weight, "weight")
    bo = c.param(f"{name}.out_proj.bias", out.bias, "bias") if out.bias is not None else None
    y = linear(c, merged, weight, bo, (b, t, d))
    return (transposed(c, y, (b, t, d), (1, 0, 2)) if seq_first else y), None


# why other masks are refused: the integer softmax hides keys in two forms only, the causal
# pattern and a comparison of the token ids (its exp table's smallest entry is exp(-8), not 0,
# and an additive -inf has no int8 mantissa)
_MASKS = (
    "uses an attention mask that mexc's integer softmax cannot apply: it hides each query's "
    "later keys (is_causal, nn.Transformer.generate_square_subsequent_mask, a tril buffer) and "
    "the keys a boolean mask of the token ids names (ids == pad, as key_padding_mask, a boolean "
    "attn_mask [N, 1, 1, T] or a masked_fill of the scores), alone or together; other patterns "
    "of -inf or boolean entries, and masks computed from activations, are not supported: "
    "attend over whole sequences, or add a finite float mask to the scores"
)


define(
    OpDef(
        Op.SOFTMAX,
        # key_cmp: "" or the comparison of the token ids (the second input) that hides a key
        {"rid": -1, "causal": False, "key_cmp": "", "key_value": 0},
        types=elementwise_types,
        keeps_axes=before_last,
        vjp=_softmax_vjp,
        reference=_softmax,
        frontend=(
            Pattern("function", ("torch.softmax", "torch.nn.functional.softmax"), _softmax_convert),
            Pattern("method", ("softmax",), _softmax_convert),
            Pattern("module", ("torch.nn.Softmax", "torch.nn.Softmax2d"), _softmax_module),
            Pattern("module", ("torch.nn.Softmin",), _softmin),
            Pattern("function", ("torch.nn.functional.softmin",), _softmin),
            Pattern("method", ("masked_fill", "masked_fill_"), _masked_fill),
            Pattern("function", ("torch.masked_fill",), _masked_fill),
            Pattern("function", ("torch.where",), _where_convert),
            Pattern("method", ("where",), _where_convert),
            Pattern(
                "function", ("torch.nn.functional.log_softmax", "torch.log_softmax"), _log_softmax
            ),
            Pattern("method", ("log_softmax",), _log_softmax),
            Pattern("module", ("torch.nn.LogSoftmax",), _log_softmax),
        ),
        lower={"tir": "step_plan:PlanRules.softmax", "c": "emit:_softmax"},
        doc="softmax over the last axis through the integer exp table",
        data_parallel=True,
    ),
    OpDef(
        Op.SOFTMAX_GRAD,
        {"rid": -1},
        reference=_softmax_grad,
        lower={"tir": "step_plan:PlanRules.softmax_grad", "c": "emit:_softmax_grad"},
        doc="dx = p * (dy - sum(p * dy))",
        data_parallel=True,
    ),
    OpDef(
        Op.MATMUL,
        {"rid": -1, **CAP},
        types=elementwise_types,  # product and compaction in one kernel
        vjp=_matmul_vjp,
        reference=_matmul,
        frontend=(
            Pattern("function", ("operator.matmul", "torch.matmul", "torch.bmm"), matmul_convert),
            Pattern("method", ("matmul", "bmm"), matmul_convert),
            Pattern("function", ("torch.functional.einsum",), einsum_convert),
            Pattern("function", ("torch.nn.functional.scaled_dot_product_attention",), _sdpa),
            Pattern("module", ("torch.nn.MultiheadAttention",), _mha_module),
        ),
        lower={
            "tir": "step_plan:PlanRules.matmul",
            "c": "emit:_matmul",
            "gemm": "products_build:matmul_forms",
        },
        product=True,
        reduction=_matmul_k,
        doc="batched [..., M, K] @ [..., K, N] of two activations, compacted",
        data_parallel=True,
    ),
    OpDef(
        Op.MATMUL_GRAD,
        {"rid": -1, **CAP},
        reference=_matmul_grad,
        lower={
            "tir": "step_plan:PlanRules.matmul_grad",
            "c": "emit:_matmul_grad",
            "gemm": "products_build:matmul_grad_forms",
        },
        product=True,
        reduction=_matmul_grad_k,
        doc="da = dy @ b^T and db = a^T @ dy, compacted",
        data_parallel=True,
    ),
)
