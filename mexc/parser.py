"""Parse mexc IR text (the form `mexc.printer` writes) back into a `Graph`.

`parse_graph(print_graph(g)) == g` for every graph whose attribute values are ints, bools,
strings, floats (not NaN), None or tuples of those. Lines starting with `//` are comments, except
the `// graph {...}` header; a node line may end in `// loc`. Missing node attributes take their
schema defaults, so hand-written IR can be brief.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from mexc.errors import ParseError
from mexc.ir import Graph, Node, Op, Value
from mexc.ops import ATTRS, SCHEMA
from mexc.types import TensorType, parse_type

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>//)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<value>%[0-9]+(?:\#[0-9]+)?)
  | (?P<range>-?[0-9]+\.\.-?[0-9]+(?::-?[0-9]+)?)
  | (?P<number>-?(?:[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|inf\b))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[{}\[\](),=:<>])
    """,
    re.VERBOSE,
)

_HEADER = re.compile(r"graph\s*\{")
_OPS = {op.value: op for op in Op}


@dataclass
class _Tok:
    kind: str
    text: str


class _Line:
    """Tokens of one line plus the trailing `// comment` text (None when absent)."""

    def __init__(self, text: str, lineno: int) -> None:
        self.text = text
        self.lineno = lineno
        self.toks: list[_Tok] = []
        self.comment: str | None = None
        self.pos = 0
        i = 0
        while i < len(text):
            m = _TOKEN.match(text, i)
            if m is None or m.lastgroup is None:
                self.fail(f"unexpected character {text[i]!r} at column {i + 1}")
            if m.lastgroup == "comment":
                self.comment = text[m.end() :].strip()
                break
            if m.lastgroup != "ws":
                self.toks.append(_Tok(m.lastgroup, m.group()))
            i = m.end()

    def fail(self, message: str) -> NoReturn:
        raise ParseError(message, self.lineno, self.text)

    def peek(self, text: str | None = None, kind: str | None = None) -> bool:
        if self.pos >= len(self.toks):
            return False
        t = self.toks[self.pos]
        return (text is None or t.text == text) and (kind is None or t.kind == kind)

    def next(self, what: str) -> _Tok:
        if self.pos >= len(self.toks):
            self.fail(f"expected {what}, found end of line")
        t = self.toks[self.pos]
        self.pos += 1
        return t

    def expect(self, text: str) -> None:
        t = self.next(f"'{text}'")
        if t.text != text:
            self.fail(f"expected '{text}', found '{t.text}'")

    def accept(self, text: str) -> bool:
        if self.peek(text):
            self.pos += 1
            return True
        return False

    def done(self) -> None:
        if self.pos < len(self.toks):
            self.fail(f"unexpected '{self.toks[self.pos].text}' at end of line")

    # --- grammar pieces -------------------------------------------------------------------

    def name(self) -> str:
        t = self.next("a name")
        if t.kind == "ident":
            return t.text
        if t.kind == "string":
            return self.string(t)
        self.fail(f"expected a name, found '{t.text}'")

    def string(self, t: _Tok) -> str:
        try:
            s = json.loads(t.text)
        except json.JSONDecodeError as e:
            self.fail(f"bad string literal {t.text}: {e.msg}")
        assert isinstance(s, str)
        return s

    def value_ref(self) -> Value:
        t = self.next("a value like %3 or %3#1")
        if t.kind != "value":
            self.fail(f"expected a value like %3 or %3#1, found '{t.text}'")
        node, _, index = t.text[1:].partition("#")
        return Value(int(node), int(index) if index else 0)

    def attr_value(self) -> Any:
        t = self.next("an attribute value")
        if t.kind == "number":
            if t.text.lstrip("-").isdigit():
                return int(t.text)
            return float(t.text)
        if t.kind == "string":
            return self.string(t)
        if t.kind == "ident":
            consts: dict[str, Any] = {"true": True, "false": False, "none": None}
            consts.update({"nan": float("nan"), "inf": float("inf")})
            if t.text in consts:
                return consts[t.text]
        if t.text == "[":
            items: list[Any] = []
            if not self.accept("]"):
                self.list_item(items)
                while self.accept(","):
                    self.list_item(items)
                self.expect("]")
            return tuple(items)
        self.fail(f"expected an attribute value, found '{t.text}'")

    def list_item(self, items: list[Any]) -> None:
        """One item of a list attribute, or the integers of a range `a..b` or `a..b:step`
        (Python's range: b excluded)."""
        t = self.toks[self.pos] if self.pos < len(self.toks) else None
        if t is not None and t.kind == "range":
            self.pos += 1
            start, _, rest = t.text.partition("..")
            stop, _, step = rest.partition(":")
            if step and int(step) == 0:
                self.fail(f"range '{t.text}' has step 0")
            items.extend(range(int(start), int(stop), int(step or 1)))
            return
        items.append(self.attr_value())

    def attr_dict(self) -> list[tuple[str, Any]]:
        self.expect("{")
        items: list[tuple[str, Any]] = []
        if self.accept("}"):
            return items
        while True:
            key = self.name()
            if any(key == k for k, _ in items):
                self.fail(f"attribute '{key}' given twice")
            self.expect("=")
            items.append((key, self.attr_value()))
            if self.accept("}"):
                return items
            self.expect(",")

    def type_(self) -> TensorType:
        start = self.pos
        kind = self.next("a type")
        if kind.kind != "ident":
            self.fail(f"expected a type like mx<i8,e=tensor>[4,4], found '{kind.text}'")
        if self.accept("<"):
            while not self.accept(">"):
                self.next("'>'")
        self.expect("[")
        while not self.accept("]"):
            self.next("']'")
        text = "".join(t.text for t in self.toks[start : self.pos])
        try:
            return parse_type(text)
        except ValueError as e:
            self.fail(f"bad type {text!r}: {e}")


def _loc(comment: str, line: _Line) -> str:
    if comment.startswith('"'):
        return line.string(_Tok("string", comment))
    return comment


def _parse_node(line: _Line) -> Node:
    ref = line.next("a node id")
    if ref.kind != "value" or "#" in ref.text:
        line.fail(f"expected a node id like %7, found '{ref.text}'")
    node_id = int(ref.text[1:])
    count: int | None = None
    if line.accept(":"):
        t = line.next("a result count")
        if t.kind != "number" or not t.text.isdigit():
            line.fail(f"expected a result count after ':', found '{t.text}'")
        count = int(t.text)
    line.expect("=")
    op_tok = line.next("an op name")
    op = _OPS.get(op_tok.text)
    if op is None:
        line.fail(f"unknown op '{op_tok.text}'")
    inputs: list[Value] = []
    if line.peek(kind="value"):
        inputs.append(line.value_ref())
        while line.accept(","):
            inputs.append(line.value_ref())
    values: dict[str, Any] = {}
    if line.peek("{"):
        for key, v in line.attr_dict():
            if key not in SCHEMA[op]:
                known = ", ".join(SCHEMA[op]) or "none"
                line.fail(f"op {op.value} has no attribute '{key}' (it has: {known})")
            values[key] = v
    line.expect(":")
    types: list[TensorType] = []
    if line.accept("("):
        if not line.accept(")"):
            types.append(line.type_())
            while line.accept(","):
                types.append(line.type_())
            line.expect(")")
    else:
        types.append(line.type_())
    line.done()
    if count is None and len(types) != 1:
        line.fail(f"node has {len(types)} result types; write %{node_id}:{len(types)} = ...")
    if count is not None and count != len(types):
        line.fail(f"%{node_id}:{count} declares {count} results but lists {len(types)} types")
    loc = _loc(line.comment, line) if line.comment is not None else ""
    return Node(node_id, op, tuple(inputs), tuple(types), ATTRS[op](**values), loc)


def _parse_return(line: _Line) -> tuple[tuple[str, Value], ...]:
    line.expect("return")
    line.expect("{")
    outs: list[tuple[str, Value]] = []
    if not line.accept("}"):
        while True:
            key = line.name()
            line.expect("=")
            outs.append((key, line.value_ref()))
            if line.accept("}"):
                break
            line.expect(",")
    line.done()
    return tuple(outs)


def parse_graph(text: str) -> Graph:
    """Parse IR text into a Graph; raises ParseError naming the line on malformed input."""
    nodes: list[Node] = []
    outputs: tuple[tuple[str, Value], ...] | None = None
    attrs: tuple[tuple[str, Any], ...] | None = None
    for lineno, raw in enumerate(text.split("\n"), start=1):
        stripped = raw.strip()
        if not stripped:
            continue
        if stripped.startswith("//"):
            body = stripped[2:].strip()
            if _HEADER.match(body):
                if attrs is not None:
                    raise ParseError("a second '// graph {...}' header", lineno, raw)
                if nodes or outputs is not None:
                    raise ParseError("the '// graph {...}' header must come first", lineno, raw)
                line = _Line(body[len("graph") :], lineno)  # '{...}'
                attrs = tuple(line.attr_dict())
                line.done()
            continue
        line = _Line(stripped, lineno)
        if outputs is not None:
            line.fail("text after the 'return {...}' line")
        if line.peek("return"):
            outputs = _parse_return(line)
        else:
            nodes.append(_parse_node(line))
    if outputs is None:  # the printer always ends with it: a file cut short lacks it
        raise ParseError(
            "the text ends without its 'return {...}' line (the file is truncated, or is not "
            "a whole graph)",
            lineno,
        )
    return Graph(tuple(nodes), outputs, attrs or ())
