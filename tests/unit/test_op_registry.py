"""The op registry is the one definition of every op (mexc/ops)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mexc.ir import Op
from mexc.ops import REGISTRY
from mexc.ops.coverage import table
from mexc.ops.registry import BACKEND_LOWERING, INFERENCE_LOWERING

ROOT = Path(__file__).resolve().parents[2]


def test_every_op_has_one_definition() -> None:
    assert set(REGISTRY) == set(Op)


@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.value)
def test_every_named_lowering_exists(op: Op) -> None:
    d = REGISTRY[op]
    for key in d.lower:
        assert callable(d.resolve(key)), (op, key)
    for p in d.frontend:
        assert p.kind in ("module", "function", "method") and callable(p.convert)
    assert set(d.lower) <= {*BACKEND_LOWERING.values(), *INFERENCE_LOWERING, "gemm"}


def test_forward_ops_are_named_in_at_most_three_files() -> None:
    """No table keyed by Op outside the registry: a forward op's Op.X appears in its family
    module and at most two other modules (the frontend's structural glue, a pass that creates
    it)."""
    sources = {p: p.read_text() for p in (ROOT / "mexc").rglob("*.py")}
    forward = [o for o, d in REGISTRY.items() if not d.boundary and (d.frontend or d.types)]
    assert len(forward) > 20
    wide = {}
    for op in forward:
        pattern = re.compile(rf"\bOp\.{op.name}\b")
        files = [p.relative_to(ROOT) for p, text in sources.items() if pattern.search(text)]
        if len(files) > 3:
            wide[op.value] = files
    assert not wide, wide


def test_coverage_doc_is_generated_from_the_registry() -> None:
    doc = (ROOT / "docs" / "ops.md").read_text()
    assert doc == table(), "docs/ops.md is stale: python -m mexc.ops.coverage > docs/ops.md"
