"""The IR verifier: well-formedness rules checked after every pass.

Rules are data: `NODE_RULES` holds (name, check) pairs run on each node in order, `GRAPH_RULES`
checks on the whole graph. A check returns None when the rule holds, else a one-sentence message.
`verify` raises `VerificationError` for the first broken rule, naming the node and printing it.

Stage-dependent rules: `integer_only` (no float values, after insert-mx-types) and `caps_assigned`
(every accumulating op has a shift cap, after assign-shift-caps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from mexc.errors import VerificationError
from mexc.ir import Graph, Node, Op, Value
from mexc.ops import ATTRS, BOUNDARY_OPS, PRODUCT_OPS, REGISTRY, op_def
from mexc.types import Kind, TensorType

CAPPED_OPS = PRODUCT_OPS | {op for op, d in REGISTRY.items() if d.aligned_sum}


@dataclass
class VerifyContext:
    """What the rules see besides the node: options and the nodes seen so far."""

    graph: Graph
    integer_only: bool = False
    caps_assigned: bool = False
    earlier: dict[int, Node] = field(default_factory=dict)  # nodes before the current one
    users: dict[Value, list[Node]] = field(default_factory=dict)


NodeCheck = Callable[[Node, VerifyContext], str | None]
GraphCheck = Callable[[VerifyContext], tuple[Node | None, str] | None]


# --- node rules ---------------------------------------------------------------------------------


def _unique_id(n: Node, cx: VerifyContext) -> str | None:
    if n.id in cx.earlier:
        return f"node id %{n.id} is used by an earlier node too."
    return None


def _well_typed_fields(n: Node, cx: VerifyContext) -> str | None:
    if not isinstance(n.id, int) or isinstance(n.id, bool) or n.id < 0:
        return f"node id {n.id!r} is not a non-negative int."
    if not isinstance(n.op, Op):
        return f"op {n.op!r} is not a mexc.ir.Op."
    if not isinstance(n.inputs, tuple) or not all(isinstance(v, Value) for v in n.inputs):
        return "inputs must be a tuple of mexc.ir.Value."
    if not isinstance(n.types, tuple) or not all(isinstance(t, TensorType) for t in n.types):
        return "types must be a tuple of mexc.types.TensorType."
    if not isinstance(n.loc, str):
        return f"loc {n.loc!r} is not a string."
    return None


def _inputs_defined_earlier(n: Node, cx: VerifyContext) -> str | None:
    for i, v in enumerate(n.inputs):
        src = cx.earlier.get(v.node)
        if v.node == n.id:
            return f"input {i} ({v}) refers to the node itself."
        if src is None:
            later = any(m.id == v.node for m in cx.graph.nodes)
            why = "is defined later (nodes must be in execution order)" if later else "is undefined"
            return f"input {i} ({v}) {why}."
        if not 0 <= v.index < len(src.types):
            return f"input {i} ({v}) asks for result {v.index} of a node with {len(src.types)}."
    return None


def _attrs_class(n: Node, cx: VerifyContext) -> str | None:
    want = ATTRS[n.op]
    if type(n.attrs) is not want:
        return f"attrs must be a mexc.ops.{want.__name__}, not {type(n.attrs).__name__}."
    return None


def _printable_value(v: object) -> bool:
    if v is None or isinstance(v, bool | int | str):
        return True
    if isinstance(v, float):
        return v == v  # NaN does not round-trip by equality
    if isinstance(v, tuple):
        return all(_printable_value(x) for x in v)
    return False


def _attr_values(n: Node, cx: VerifyContext) -> str | None:
    for f in dataclasses.fields(n.attrs):
        v = getattr(n.attrs, f.name)
        if not _printable_value(v):
            return (
                f"attribute {f.name}={v!r} is not an int, bool, str, float (not NaN), None or "
                "tuple of those, so the IR text cannot carry it."
            )
    return None


def _kind_of(v: object) -> str:
    """An attribute value's kind, as the text form writes it, with its article."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, int | float):
        return "a number" if isinstance(v, float) else "an int"
    return "a str" if isinstance(v, str) else "a list"


def _attr_kinds(n: Node, cx: VerifyContext) -> str | None:
    """Each attribute holds the kind of its default in the registry (an int where the op
    counts, a number where a float is allowed); a default of None allows any kind."""
    for name, default in op_def(n.op).attrs.items():
        want, v = _kind_of(default), getattr(n.attrs, name)
        got = _kind_of(v)
        if default is None or got == want or (want == "a number" and got == "an int"):
            continue
        return f"attribute {name}={v!r} is {got}; {n.op.value} takes {want} there."
    return None


def _bits_agree(n: Node, cx: VerifyContext) -> str | None:
    """A node's `bits` is the program's (backends read the program's, the reference the
    node's: a node of its own width would run differently on each)."""
    bits, program = getattr(n.attrs, "bits", None), cx.graph.attr("bits")
    if bits is None or program is None or bits == program:
        return None
    return f"attribute bits={bits!r}, but the program's bits (graph header) are {program!r}."


def _boundary_no_inputs(n: Node, cx: VerifyContext) -> str | None:
    if n.op in BOUNDARY_OPS and n.inputs:
        return f"boundary op {n.op.value} must not have inputs."
    return None


def _f32_allowed(n: Node, index: int, cx: VerifyContext) -> bool:
    d = op_def(n.op)
    if index in d.float_results:
        return True  # the float batch
    if d.loss_head and n.types[index].shape == ():
        return True  # the logging-only loss
    users = cx.users.get(Value(n.id, index), [])
    return bool(users) and all(op_def(u.op).reads_float for u in users)


def _integer_only(n: Node, cx: VerifyContext) -> str | None:
    if not cx.integer_only:
        return None
    for i, t in enumerate(n.types):
        if t.kind is Kind.F32 and not _f32_allowed(n, i, cx):
            return (
                f"result {i} has float type {t} in an integer-only program (float is allowed "
                "only for input nodes, values read only by quantize, and the scalar loss)."
            )
    if not op_def(n.op).reads_float:
        for i, v in enumerate(n.inputs):
            t = cx.earlier[v.node].types[v.index]
            if t.kind is Kind.F32:
                return f"input {i} ({v}) has float type {t}; only quantize may read floats."
    return None


def _shift_cap_assigned(n: Node, cx: VerifyContext) -> str | None:
    if n.op not in CAPPED_OPS or not hasattr(n.attrs, "shift_cap"):
        return None
    cap = n.attrs.shift_cap
    if cap is None:
        if cx.caps_assigned:
            return "shift_cap is not assigned (assign-shift-caps must set it on every such op)."
        return None
    if isinstance(cap, bool) or not isinstance(cap, int):
        return f"shift_cap={cap!r} must be an int (negative means pre_shift the operand)."
    return None


NODE_RULES: list[tuple[str, NodeCheck]] = [
    ("field-types", _well_typed_fields),
    ("unique-id", _unique_id),
    ("inputs-defined-earlier", _inputs_defined_earlier),
    ("attrs-class", _attrs_class),
    ("attr-values", _attr_values),
    ("attr-kinds", _attr_kinds),
    ("bits-agree", _bits_agree),
    ("boundary-no-inputs", _boundary_no_inputs),
    ("integer-only", _integer_only),
    ("shift-cap", _shift_cap_assigned),
]


# --- graph rules --------------------------------------------------------------------------------


def _outputs_exist(cx: VerifyContext) -> tuple[Node | None, str] | None:
    by_id = cx.graph.by_id()
    for name, v in cx.graph.outputs:
        if not isinstance(name, str) or not isinstance(v, Value):
            return None, f"output {name!r} must be a (str, Value) pair."
        src = by_id.get(v.node)
        if src is None:
            return None, f"output {name!r} refers to {v}, which is not a node of the graph."
        if not 0 <= v.index < len(src.types):
            return src, f"output {name!r} refers to {v}, but the node has {len(src.types)} results."
    return None


def _output_names_unique(cx: VerifyContext) -> tuple[Node | None, str] | None:
    seen: set[str] = set()
    for name, _ in cx.graph.outputs:
        if name in seen:
            return None, f"output name {name!r} is used twice."
        seen.add(name)
    return None


def _graph_attrs_unique(cx: VerifyContext) -> tuple[Node | None, str] | None:
    names = [k for k, _ in cx.graph.attrs]
    twice = sorted({k for k in names if names.count(k) > 1})
    if twice:
        return None, f"graph attribute(s) {twice} given twice."
    return None


GRAPH_RULES: list[tuple[str, GraphCheck]] = [
    ("outputs-exist", _outputs_exist),
    ("output-names-unique", _output_names_unique),
    ("graph-attrs-unique", _graph_attrs_unique),
]


def verify(
    g: Graph, stage: str = "", *, integer_only: bool = False, caps_assigned: bool = False
) -> None:
    """Check the rules of `NODE_RULES` and `GRAPH_RULES`; raise VerificationError on the first
    broken one. `stage` names the pass that produced `g` (for the message)."""
    cx = VerifyContext(g, integer_only=integer_only, caps_assigned=caps_assigned)
    if integer_only:
        cx.users = g.users()
    for n in g.nodes:
        for rule, check in NODE_RULES:
            message = check(n, cx)
            if message is not None:
                raise VerificationError(stage, n, message, rule=rule)
        cx.earlier[n.id] = n
    for rule, gcheck in GRAPH_RULES:
        found = gcheck(cx)
        if found is not None:
            raise VerificationError(stage, found[0], found[1], rule=rule)
