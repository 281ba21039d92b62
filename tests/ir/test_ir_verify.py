"""Each verifier rule catches a deliberately broken graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from mexc.errors import VerificationError
from mexc.ir import Graph, Node, Op, Value
from mexc.ops import ATTRS, attrs
from mexc.types import Kind, TensorType, f32, mx
from mexc.verify import GRAPH_RULES, NODE_RULES, verify


def _replace_node(g: Graph, node_id: int, **changes: object) -> Graph:
    nodes = tuple(n.with_(**changes) if n.id == node_id else n for n in g.nodes)
    return dataclasses.replace(g, nodes=nodes)


def test_sample_is_valid_at_every_stage(sample: Graph) -> None:
    verify(sample)
    verify(sample, "plan-memory", integer_only=True, caps_assigned=True)


Breaker = Callable[[Graph], Graph]

CASES: list[tuple[str, Breaker, int | None, str]] = [
    ("field-types", lambda g: _replace_node(g, 5, inputs=[Value(4)]), 5, "tuple of mexc.ir.Value"),
    ("field-types", lambda g: _replace_node(g, 5, types=(f32(2), "f32[2]")), 5, "TensorType"),
    ("unique-id", lambda g: _replace_node(g, 5, id=4), 4, "used by an earlier node"),
    (
        "inputs-defined-earlier",
        lambda g: _replace_node(g, 4, inputs=(Value(3), Value(5))),
        4,
        "defined later",
    ),
    ("inputs-defined-earlier", lambda g: _replace_node(g, 5, inputs=(Value(99),)), 5, "undefined"),
    ("inputs-defined-earlier", lambda g: _replace_node(g, 5, inputs=(Value(5),)), 5, "itself"),
    (
        "inputs-defined-earlier",
        lambda g: _replace_node(g, 5, inputs=(Value(4, 1),)),
        5,
        "result 1 of a node with 1",
    ),
    ("attrs-class", lambda g: _replace_node(g, 5, attrs=attrs(Op.RELU6)), 5, "ReluAttrs"),
    ("attrs-class", lambda g: _replace_node(g, 5, attrs=None), 5, "NoneType"),
    (
        "attr-values",
        lambda g: _replace_node(g, 3, attrs=ATTRS[Op.QUANTIZE](bits=[8])),
        3,
        "bits=[8]",
    ),
    (
        "attr-values",
        lambda g: _replace_node(g, 0, attrs=ATTRS[Op.INPUT](name=float("nan"))),
        0,
        "NaN",
    ),
    (
        "attr-kinds",
        lambda g: _replace_node(g, 3, attrs=ATTRS[Op.QUANTIZE](bits="eight")),
        3,
        "bits='eight' is a str; quantize takes an int there",
    ),
    (
        "bits-agree",
        lambda g: _replace_node(g, 3, attrs=ATTRS[Op.QUANTIZE](bits=5)),
        3,
        "program's bits (graph header) are 8",
    ),
    ("boundary-no-inputs", lambda g: _replace_node(g, 2, inputs=(Value(0),)), 2, "param"),
    (
        "shift-cap",
        lambda g: _replace_node(g, 4, attrs=dataclasses.replace(g.node(4).attrs, shift_cap=1.5)),
        4,
        "must be an int",
    ),
    (
        "outputs-exist",
        lambda g: dataclasses.replace(g, outputs=(("a", Value(42)),)),
        None,
        "not a node",
    ),
    (
        "outputs-exist",
        lambda g: dataclasses.replace(g, outputs=(("a", Value(6, 3)),)),
        6,
        "3 results",
    ),
    (
        "output-names-unique",
        lambda g: dataclasses.replace(g, outputs=(("a", Value(5)), ("a", Value(4)))),
        None,
        "used twice",
    ),
    (
        "graph-attrs-unique",
        lambda g: dataclasses.replace(g, attrs=(("bits", 8), ("batch", 4), ("batch", 2))),
        None,
        "['batch'] given twice",
    ),
]


@pytest.mark.parametrize(("rule", "breaker", "node_id", "words"), CASES)
def test_rule_catches(
    sample: Graph, rule: str, breaker: Breaker, node_id: int | None, words: str
) -> None:
    with pytest.raises(VerificationError) as info:
        verify(breaker(sample), "my-pass")
    e = info.value
    assert e.rule == rule and e.stage == "my-pass"
    assert words in e.message
    assert "after pass 'my-pass'" in str(e)
    if node_id is None:
        assert e.node is None
    else:
        assert e.node is not None and e.node.id == node_id
        assert f"%{node_id}" in str(e)


def test_every_rule_has_a_case() -> None:
    names = {name for name, _ in NODE_RULES} | {name for name, _ in GRAPH_RULES}
    assert names - {c[0] for c in CASES} == {"integer-only"}  # tested below


def _float_relu(g: Graph) -> Graph:
    return _replace_node(g, 5, types=(f32(4, 16, 8, 8),))


def test_integer_only_rejects_float_results(sample: Graph) -> None:
    broken = _float_relu(sample)
    verify(broken)  # fine before insert-mx-types
    with pytest.raises(VerificationError) as info:
        verify(broken, "insert-mx-types", integer_only=True)
    assert info.value.rule == "integer-only" and info.value.node is not None
    assert info.value.node.id == 5 and "f32[4,16,8,8]" in info.value.message


def test_integer_only_rejects_float_inputs_except_for_quantize(sample: Graph) -> None:
    # the conv reads the float input directly instead of its quantized form
    broken = _replace_node(sample, 4, inputs=(Value(0), Value(2)))
    with pytest.raises(VerificationError) as info:
        verify(broken, integer_only=True)
    assert info.value.rule == "integer-only" and "only quantize may read floats" in str(info.value)


def test_integer_only_allows_param_read_only_by_quantize(sample: Graph) -> None:
    g = _replace_node(sample, 2, types=(f32(16, 1, 3, 3),))
    g = _replace_node(g, 4, inputs=(Value(3), Value(9)))
    q = Node(9, Op.QUANTIZE, (Value(2),), (mx(16, 1, 3, 3),), attrs(Op.QUANTIZE))
    nodes = (*g.nodes[:4], q, *g.nodes[4:])
    g = dataclasses.replace(g, nodes=nodes)
    g = _replace_node(g, 6, inputs=(Value(5), Value(9)))
    verify(g, integer_only=True)


def test_integer_only_allows_only_the_scalar_loss(sample: Graph) -> None:
    bad = TensorType(Kind.F32, (4,))
    g = _replace_node(sample, 7, types=(bad, sample.node(7).types[1]))
    with pytest.raises(VerificationError, match="integer-only"):
        verify(g, integer_only=True)


def test_caps_must_be_assigned_after_assign_shift_caps(sample: Graph) -> None:
    g = _replace_node(sample, 4, attrs=dataclasses.replace(sample.node(4).attrs, shift_cap=None))
    verify(g)  # fine before assign-shift-caps
    with pytest.raises(VerificationError) as info:
        verify(g, "assign-shift-caps", caps_assigned=True)
    assert info.value.rule == "shift-cap" and "not assigned" in info.value.message


def test_message_prints_the_node_line(sample: Graph) -> None:
    with pytest.raises(VerificationError) as info:
        verify(_replace_node(sample, 5, inputs=(Value(99),)))
    assert "in the input graph" in str(info.value)
    assert "Offending node: %5 = relu %99 : mx<i8,e=tensor>[4,16,8,8]" in str(info.value)


def test_negative_shift_cap_is_allowed(sample: Graph) -> None:
    g = _replace_node(
        sample, 4, attrs=dataclasses.replace(sample.node(4).attrs, shift_cap=-3, pre_shift=3)
    )
    verify(g, caps_assigned=True)
