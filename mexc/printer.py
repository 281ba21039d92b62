"""Text form of the mexc IR (see docs/ir.md); `mexc.parser.parse_graph` is its exact inverse.

// graph {bits=8, batch=128}
%0 = input {name="x"} : f32[128,1,28,28]  // train.py:12
%7 = conv2d_compact %3, %1 {stride=[1,1], ..., rid=4} : mx<i8,e=tensor>[128,16,28,28]
%9:3 = batchnorm_grad %8, %5 {rid=7} : (mx<i8,e=tensor>[128,16,28,28], acc<i32,e=tensor>[16],
       acc<i32,e=tensor>[16])                                   (one line in real output)
return {loss=%20, "state:conv1.weight"=%31}
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from mexc.ir import Graph, Node

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KEYWORDS = frozenset({"true", "false", "none", "inf", "nan", "return"})


def format_string(s: str) -> str:
    """A double-quoted string literal (JSON escapes, ASCII only)."""
    return json.dumps(s, ensure_ascii=True)


def format_name(name: str) -> str:
    """An attribute or output name: bare when it is an identifier, else quoted."""
    if _IDENT.match(name) and name not in _KEYWORDS:
        return name
    return format_string(name)


def format_value(v: Any) -> str:
    """An attribute value: int, `true`/`false`, "string", float (repr), [a,b] or `none`."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        # '1e-05', '0.5', 'inf', '-inf': always has '.', 'e' or is inf (float(): a NumPy
        # scalar's own repr is 'np.float64(0.5)')
        return repr(float(v))
    if isinstance(v, str):
        return format_string(v)
    if isinstance(v, tuple | list):
        return "[" + ",".join(_items(v)) + "]"
    raise TypeError(f"cannot print attribute value {v!r} of type {type(v).__name__}")


RUN = 4  # runs of this many integers or more in one step print as a range


def _items(v: tuple | list) -> list[str]:
    """A list's items, runs of RUN or more integers in one nonzero step as Python's range
    `a..b` (step 1) or `a..b:step`, b excluded (a gather_param's index map is mostly such runs:
    a window mask repeated over heads, a bias table read head by head)."""
    out: list[str] = []
    i = 0
    while i < len(v):
        j = i + 1
        if j < len(v) and _int(v[i]) and _int(v[j]) and v[j] != v[i]:
            step = v[j] - v[i]
            while j + 1 < len(v) and _int(v[j + 1]) and v[j + 1] - v[j] == step:
                j += 1
            if j - i + 1 >= RUN:
                stop = f"{v[j] + step}" + ("" if step == 1 else f":{step}")
                out.append(f"{v[i]}..{stop}")
                i = j + 1
                continue
        out.append(format_value(v[i]))
        i += 1
    return out


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def format_attrs(items: list[tuple[str, Any]]) -> str:
    """`{a=1, b=[1,2]}`, or "" when there are none."""
    if not items:
        return ""
    return "{" + ", ".join(f"{format_name(k)}={format_value(v)}" for k, v in items) + "}"


def _node_attr_items(node: Node) -> list[tuple[str, Any]]:
    a = node.attrs
    if a is None or not dataclasses.is_dataclass(a) or isinstance(a, type):
        return []
    return [(f.name, getattr(a, f.name)) for f in dataclasses.fields(a)]


def format_loc(loc: str) -> str:
    """A loc comment body: raw when it is plain printable text, else a quoted string."""
    if loc.isprintable() and loc == loc.strip() and not loc.startswith('"'):
        return loc
    return format_string(loc)


def print_node(node: Node) -> str:
    """One line: `%ID[:N] = op operands {attrs} : type(s)  // loc`."""
    n = len(node.types)
    lhs = f"%{node.id}" if n == 1 else f"%{node.id}:{n}"
    parts = [f"{lhs} = {node.op.value}"]
    if node.inputs:
        parts.append(", ".join(str(v) for v in node.inputs))
    attrs = format_attrs(_node_attr_items(node))
    if attrs:
        parts.append(attrs)
    types = ", ".join(str(t) for t in node.types)
    parts.append(": " + (types if n == 1 else f"({types})"))
    line = " ".join(parts)
    if node.loc:
        line += "  // " + format_loc(node.loc)
    return line


def print_outputs(outputs: tuple[tuple[str, Any], ...]) -> str:
    return "return {" + ", ".join(f"{format_name(k)}={v}" for k, v in outputs) + "}"


def print_graph(g: Graph) -> str:
    """The whole graph: a `// graph {...}` header, one line per node, a `return {...}` line."""
    lines = ["// graph " + (format_attrs(list(g.attrs)) or "{}")]
    lines.extend(print_node(n) for n in g.nodes)
    lines.append(print_outputs(g.outputs))
    return "\n".join(lines) + "\n"
