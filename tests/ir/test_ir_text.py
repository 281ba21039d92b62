"""Printer and parser: golden text, hypothesis round trip, parse errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mexc.errors import ParseError
from mexc.ir import Graph, Node, Op, Value
from mexc.ops import ATTRS, SCHEMA
from mexc.parser import parse_graph
from mexc.printer import print_graph
from mexc.types import Exp, Kind, TensorType

GOLDEN = """\
// graph {bits=8, batch=4}
%0 = input {name="x", vocab=0} : f32[4,1,8,8]  // train.py:12
%1 = label {name="y", num_classes=10} : i64[4]
%2 = param {name="conv1.weight", role="weight"} : mx<i8,e=axis0>[16,1,3,3]
%3 = quantize %0 {bits=8} : mx<i8,e=tensor>[4,1,8,8]
%4 = conv2d_compact %3, %2 {stride=[1,1], padding=[1,1], groups=1, has_bias=false, \
shift_cap=17, pre_shift=0, bits=8, rid=4} : mx<i8,e=tensor>[4,16,8,8]  // models.py:23
%5 = relu %4 : mx<i8,e=tensor>[4,16,8,8]
%6:3 = batchnorm_grad %5, %2 {rid=7} : (mx<i8,e=tensor>[4,16,8,8], acc<i32,e=tensor>[16], \
acc<i32,e=tensor>[16])
%7:2 = softmax_ce %6, %1 {num_classes=10, rid=8} : (f32[], i16[4,10])
return {loss=%7, "state:conv1.weight"=%6#2}
"""


def test_golden_text(sample: Graph) -> None:
    assert print_graph(sample) == GOLDEN
    assert parse_graph(GOLDEN) == sample


def test_comments_and_blank_lines_are_ignored(sample: Graph) -> None:
    text = "// ----- IR after fuse-products -----\n\n" + GOLDEN.replace(
        "%5 = relu", "// a note about graph structure\n%5 = relu"
    )
    assert parse_graph(text) == sample


def test_missing_attrs_take_defaults() -> None:
    g = parse_graph("%0 = input : f32[2]\n%1 = quantize %0 : mx<i8,e=tensor>[2]\nreturn {}")
    assert g.nodes[1].attrs == ATTRS[Op.QUANTIZE]()
    assert g.attrs == () and g.outputs == ()


def test_odd_values_round_trip() -> None:
    conv = ATTRS[Op.CONV2D](stride=(), padding=(-1, 2**40), groups=0, shift_cap=None)
    bn = ATTRS[Op.BATCHNORM](eps=float("inf"), momentum=-0.0, rid=-1)
    nodes = (
        Node(3, Op.INPUT, (), (TensorType(Kind.F32, ()),), ATTRS[Op.INPUT](name='a"\n\\//b')),
        Node(10, Op.CONV2D, (Value(3),), (), conv, loc=' lead "q" // \u2028 é'),
        Node(11, Op.BATCHNORM, (Value(3), Value(3)), (TensorType(Kind.IDX, (0,)),), bn, '"'),
    )
    g = Graph(
        nodes,
        (("return", Value(3)), ("", Value(11)), ("a b", Value(3))),
        (("inf", 1e-300), ("x.y", (True, "s", None))),
    )
    text = print_graph(g)
    assert parse_graph(text) == g
    assert print_graph(parse_graph(text)) == text


def test_runs_of_integers_print_as_ranges_and_parse_back() -> None:
    index = (*range(7), 9, *range(40, -8, -12), 3, 3, 3, 3, 5, True, 6, 7, 8, 9)
    node = Node(4, Op.GATHER_PARAM, (Value(3),), (), ATTRS[Op.GATHER_PARAM](index=index))
    g = Graph((node,), (), ())
    text = print_graph(g)
    assert "index=[0..7,9,40..-8:-12,3,3,3,3,5,true,6..10]" in text
    assert parse_graph(text) == g


@given(st.lists(st.integers(-50, 50), max_size=40))
def test_integer_lists_round_trip(items: list[int]) -> None:
    node = Node(4, Op.GATHER_PARAM, (Value(3),), (), ATTRS[Op.GATHER_PARAM](index=tuple(items)))
    g = Graph((node,), (), ())
    assert parse_graph(print_graph(g)) == g


# --- hypothesis: random graphs ------------------------------------------------------------------

_shapes = st.lists(st.integers(0, 300), max_size=4).map(tuple)
_types = st.one_of(
    st.builds(TensorType, st.sampled_from([Kind.F32, Kind.I64, Kind.I16, Kind.IDX]), _shapes),
    st.builds(
        TensorType, st.sampled_from([Kind.MX, Kind.ACC]), _shapes, st.sampled_from(list(Exp))
    ),
)
_ints = st.integers(-(2**63), 2**63)
_floats = st.floats(allow_nan=False)
_scalars = st.one_of(_ints, st.booleans(), st.text(), _floats, st.none())
_names = st.text(max_size=12)


def _value_for(default: Any) -> st.SearchStrategy[Any]:
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return _ints
    if isinstance(default, float):
        return _floats
    if isinstance(default, str):
        return st.text(max_size=10)
    if isinstance(default, tuple):
        return st.lists(_ints, max_size=4).map(tuple)
    return st.one_of(st.none(), st.integers(0, 31))  # shift_cap


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    nodes: list[Node] = []
    ids = sorted(draw(st.sets(st.integers(0, 10_000), max_size=10)))
    for node_id in ids:
        op = draw(st.sampled_from(list(Op)))
        values = {k: draw(_value_for(d)) for k, d in SCHEMA[op].items()}
        types = tuple(draw(st.lists(_types, min_size=1 if op is Op.RELU else 0, max_size=3)))
        refs = [Value(n.id, i) for n in nodes for i in range(len(n.types))]
        inputs = draw(st.lists(st.sampled_from(refs), max_size=3)) if refs else []
        loc = draw(st.one_of(st.just(""), st.text(max_size=20), st.just('m.py:7 // x\n"y"')))
        nodes.append(Node(node_id, op, tuple(inputs), types, ATTRS[op](**values), loc))
    refs = [Value(n.id, i) for n in nodes for i in range(len(n.types))]
    outputs = draw(st.lists(st.tuples(_names, st.sampled_from(refs)), max_size=4)) if refs else []
    gattrs = draw(
        st.lists(
            st.tuples(_names, st.one_of(_scalars, st.tuples(_scalars))),
            max_size=3,
            unique_by=lambda kv: kv[0],
        )
    )
    return Graph(tuple(nodes), tuple(outputs), tuple(gattrs))


@given(graphs())
def test_round_trip(g: Graph) -> None:
    text = print_graph(g)
    back = parse_graph(text)
    assert back == g
    assert print_graph(back) == text  # also catches bool/int and int/float mix-ups


# --- parse errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("%0 = input : f32[2]\n%1 = frobnicate %0 : f32[2]", 2, "unknown op 'frobnicate'"),
        ('%0 = input {nme="x"} : f32[2]', 1, "has no attribute 'nme'"),
        ('%0 = input {name="x", name="y"} : f32[2]', 1, "given twice"),
        ("%0 = input : f32[2]\n\n%1 = relu %0 : q32[2]", 3, "bad type"),
        ("%0 = input : f32[2] extra", 1, "unexpected 'extra'"),
        ("%0 = input : (f32[2], f32[2])", 1, "write %0:2"),
        ("%0:3 = input : (f32[2], f32[2])", 1, "declares 3 results"),
        ("%0 = relu %x : f32[2]", 1, "unexpected character"),
        ("%0 = relu %0, : f32[2]", 1, "expected a value"),
        ("%0 = input {name=@} : f32[2]", 1, "unexpected character '@'"),
        ("%0 = input {name=} : f32[2]", 1, "expected an attribute value"),
        ("%0 = input : f32[2]\nreturn {a=%0}\n%1 = relu %0 : f32[2]", 3, "after the 'return"),
        ("%0 = input : f32[2]\nreturn {a=}", 2, "expected a value"),
        ("%0 = input : f32[2]\n// graph {bits=8}", 2, "must come first"),
        ("// graph {bits=8, batch=4, bits=4}", 1, "attribute 'bits' given twice"),
        ("%0 = input : f32[2]\n%1 = relu %0 : f32[2]\n", 3, "ends without its 'return"),
        ("", 1, "ends without its 'return"),
        ("%0 = gather_param {index=[0..4:0]} : f32[2]", 1, "has step 0"),
        ("// graph {bits=8, }", 1, "expected a name"),
        ('%0 = input {name="x} : f32[2]', 1, "unexpected character"),
        ("%0 = input : mx<i8,e=tensor[2]", 1, "expected"),
        ("%0 input : f32[2]", 1, "expected '='"),
    ],
)
def test_parse_errors_name_the_line(text: str, line: int, words: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    assert info.value.line == line
    assert f"line {line}:" in str(info.value)
    assert words in str(info.value)


def test_parse_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_graph("%0 = nope : f32[2]")


def test_the_example_of_docs_ir_md_is_printer_output() -> None:
    """docs/ir.md's example is text the printer writes (its first code block, a fixed point of
    parse and print), and verifies as an integer program."""
    from pathlib import Path

    from mexc.verify import verify

    doc = (Path(__file__).parents[2] / "docs" / "ir.md").read_text()
    block = doc.split("```\n", 2)[1]
    g = parse_graph(block)
    assert print_graph(g) == block
    verify(g, integer_only=True, caps_assigned=True)
