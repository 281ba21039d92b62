"""The op registry (see `registry`): one definition per op, in the family modules below.

Importing this package registers every op. The helpers here give the attribute side of the
definitions the shape the IR, the parser and the passes use: `SCHEMA[op]` (attribute names and
defaults), `ATTRS[op]` (the frozen attribute dataclass), `attrs(op, **values)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mexc.ir import Op
from mexc.ops import (  # noqa: F401 - each module registers its ops
    activation,
    attention,
    boundary,
    collective,
    dense,
    embedding,
    gather,
    loss,
    norm,
    norm_written_out,
    optimizer,
    pool,
    tensor,
)
from mexc.ops.registry import (
    BACKEND_LOWERING,
    REGISTRY,
    AttrValue,
    OpDef,
    Pattern,
    attr_class,
    op_def,
)

_missing = set(Op) - set(REGISTRY)
if _missing:  # pragma: no cover - a new Op member without a definition
    raise ImportError(f"ops without a definition in mexc.ops: {sorted(o.value for o in _missing)}")

SCHEMA: Mapping[Op, Mapping[str, AttrValue]] = {op: d.attrs for op, d in REGISTRY.items()}
ATTRS: Mapping[Op, type] = {op: attr_class(op) for op in REGISTRY}
PRODUCT_OPS = frozenset(op for op, d in REGISTRY.items() if d.product)
BOUNDARY_OPS = frozenset(op for op, d in REGISTRY.items() if d.boundary)


def attrs(op: Op, **values: Any) -> Any:
    """Construct the attribute dataclass of `op`; unknown names are an error."""
    return REGISTRY[op].make(**values)


def attr_items(op: Op, value: Any) -> list[tuple[str, AttrValue]]:
    """(name, value) pairs of an attribute dataclass, in schema order."""
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]


def with_attrs(op: Op, value: Any, **changes: Any) -> Any:
    return dataclasses.replace(value, **changes)


__all__ = [
    "ATTRS",
    "BACKEND_LOWERING",
    "BOUNDARY_OPS",
    "PRODUCT_OPS",
    "REGISTRY",
    "SCHEMA",
    "OpDef",
    "Pattern",
    "attr_items",
    "attrs",
    "op_def",
    "with_attrs",
]
