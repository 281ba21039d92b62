"""Which parameters a program trains (sparse update): `mexc.compile(..., trainable=SPEC)`.

A frozen parameter keeps its initial value: derive-backward gives it no gradient, insert-optimizer
no state and no update, and the backward nodes only it needed are not built, so the activations
only its weight gradient read are not saved either (the memory a sparse update saves on an MCU).

SPEC is one of
    None                 every parameter (the default)
    "last:K"             the last K weight layers (convolutions and linear layers, in graph order)
                         and every parameter first used after the first of them (their biases,
                         the batch norms between them)
    "bias-norm"          biases and the affine parameters of batch and layer norms
    a pattern            fnmatch over parameter names ("fc.*", "layer4.*", "*.bias")
    several              a comma-separated string or a sequence of the above, united
                         ("last:1,bias-norm")
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from mexc.errors import MexcError
from mexc.ir import EVAL_NORM_WEIGHTS, Graph, Op, fed_by_input

WEIGHT_LAYERS = (Op.CONV2D, Op.LINEAR)
NORMS = (Op.BATCHNORM, Op.LAYERNORM)
TrainableSpec = str | Sequence[str] | None


class TrainableError(MexcError, ValueError):
    """A trainable spec that selects nothing, or names what the model does not have."""


def _first_users(g: Graph) -> dict[str, tuple[int, Op]]:
    """Each parameter's first consumer: (its position in the graph, its op). A parameter from
    which a weight is computed each step (a standardized convolution's weight, its gain) counts
    as read where the layer reads that weight, as the weight (CONV2D) or as the norm's affine
    (LAYERNORM) that computes it."""
    names = {n.out: str(n.attrs.name) for n in g.nodes_of(Op.PARAM)}
    fed = fed_by_input(g.nodes)
    computed = {n.id for n in g.nodes if n.inputs and n.id not in fed}  # parameters excluded
    users = g.users()
    position = {n.id: i for i, n in enumerate(g.nodes)}
    first: dict[str, tuple[int, Op]] = {}
    for i, n in enumerate(g.nodes):
        for k, v in enumerate(n.inputs):
            name = names.get(v)
            if name is None or name in first:
                continue
            first[name] = (i, n.op)
            role = Op.LAYERNORM if n.op is Op.LAYERNORM and k > 0 else None
            node = n
            while node.id in computed:  # on to the first reader that is not computed so
                reader = min(users.get(node.out, []), key=lambda u: position[u.id], default=None)
                if reader is None:
                    break
                if reader.op is Op.LAYERNORM and reader.inputs.index(node.out) > 0:
                    role = Op.LAYERNORM
                node = reader
                first[name] = (position[node.id], role or node.op)
    return first


def resolve_trainable(spec: TrainableSpec, g: Graph) -> frozenset[str] | None:
    """The names of the parameters `spec` trains in the frontend graph `g` (None: all). The
    parts of a comma-separated string (or the items of a sequence) are united."""
    if spec is None:
        return None
    first = _first_users(g)
    params = sorted(first, key=lambda k: first[k][0])
    if not isinstance(spec, Iterable) or isinstance(spec, bytes):
        raise TrainableError(
            f"trainable={spec!r}: give names, patterns, last:K or bias-norm (a string, or a "
            "list of them)"
        )
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    if not all(isinstance(p, str) for p in items):
        raise TrainableError(f"trainable={spec!r}: give names, patterns, last:K or bias-norm")
    parts = [p.strip() for p in items if p.strip()]
    chosen: set[str] = set()
    for part in parts:
        chosen |= _resolve_part(part, first, params, g.attr(EVAL_NORM_WEIGHTS, ()))
    if not chosen:
        raise TrainableError(
            f"trainable={spec!r} selects no parameter; the model has {_listing(params)}"
        )
    return frozenset(chosen)


def _listing(params: list[str]) -> str:
    return ", ".join(params[:12]) + (", ..." if len(params) > 12 else "")


def _resolve_part(
    part: str, first: dict[str, tuple[int, Op]], params: list[str], frozen_norms: Sequence[str]
) -> set[str]:
    if part.startswith("last:"):
        try:
            k = int(part[5:])
        except ValueError:
            k = 0
        layers = sorted({i for i, op in first.values() if op in WEIGHT_LAYERS})
        if not 1 <= k <= len(layers):
            raise TrainableError(
                f"trainable {part!r}: K must be 1..{len(layers)}, the model's weight layers "
                "(convolutions and linear layers)"
            )
        return {name for name, (i, _) in first.items() if i >= layers[-k]}
    if part == "bias-norm":
        norms = set(frozen_norms)  # a batch norm kept in eval mode is written out as products
        return {
            n for n, (_, op) in first.items() if n.endswith(".bias") or op in NORMS or n in norms
        }
    hits = {n for n in params if fnmatchcase(n, part)}
    if not hits:
        raise TrainableError(
            f"trainable pattern {part!r} matches no parameter; the model has {_listing(params)}"
        )
    return hits
