"""The import graph of the `mexc` package has no cycles.

Every module under mexc/ is parsed with `ast`; each `import` / `from ... import` anywhere in the
file counts, at module level and inside functions and methods alike: a function-level import is
a dependency that only runs later, and hiding a cycle behind one is what this test forbids.
Imports under `if TYPE_CHECKING:` do not count: they never execute, and annotations (postponed
by `from __future__ import annotations`) may name a type of a module that depends on this one.

Resolution: `import mexc.a.b` is an edge to the longest known module prefix of mexc.a.b;
`from mexc.a import b` (or `from . import b`) is an edge to mexc.a.b where that is a module,
else to mexc.a. The package's lazy public names (PEP 562: the `_LAZY` table of
mexc/__init__.py, imported with importlib by name) are edges from `mexc` to their modules,
so an internal `import mexc; mexc.compile(...)` is seen as the dependency it is. Importing a
submodule also runs its parent packages' __init__; those implicit edges are left out (a package
that imports its own submodules would otherwise be a cycle by construction). Not seen either:
the op registry's lowering references ("module:qualname" strings in mexc/ops, imported by
OpDef.lowering when a backend asks for its own lowering): data a backend resolves, not an
import of the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2] / "mexc"


def module_names() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import node of `tree` outside `if TYPE_CHECKING:` bodies (their `else` counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _lazy_targets(path: Path) -> set[str]:
    """The module names of the `_LAZY = {name: module}` table of a package __init__."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if "_LAZY" in names and isinstance(node.value, ast.Dict):
                return {ast.literal_eval(v) for v in node.value.values if v is not None}
    return set()


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _known_prefix(alias.name, modules)
                if hit:
                    out.add(hit)
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            hit = sub if sub in modules else _known_prefix(base, modules)
            if hit:
                out.add(hit)
    if is_package:
        out |= {m for m in _lazy_targets(path) if m in modules}
    out.discard(name)
    return out


def import_graph() -> nx.DiGraph:
    modules = module_names()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, dep) for dep in import_edges(name, path, modules))
    return g


def test_the_scan_sees_function_level_and_lazy_imports() -> None:
    g = import_graph()
    assert g.has_edge("mexc.compiler", "mexc.frontend")  # module level
    assert g.has_edge("mexc.targets", "mexc.backends.c.host")  # inside a function
    assert g.has_edge("mexc", "mexc.compiler")  # the package's lazy public names
    assert g.has_edge("mexc.ops.dense", "mexc.kernels")  # from mexc import kernels


def _cycles(g: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_no_import_cycles() -> None:
    g = import_graph()
    cycles = _cycles(g)
    shown = []
    for component in cycles:
        loop = next(nx.simple_cycles(g.subgraph(component)))
        shown.append(f"{len(component)} modules {component}; e.g. {' -> '.join([*loop, loop[0]])}")
    assert not cycles, "import cycles:\n" + "\n".join(shown)
