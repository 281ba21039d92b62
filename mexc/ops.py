"""Per-op attribute dataclasses (frozen), built from one schema table.

Every op's attributes are a frozen dataclass whose fields are listed in `SCHEMA` with defaults.
Values are ints, bools, strings, floats (host-side constants only: eps, dropout probability) or
tuples of ints. `rid` is the node's rounding-site id: the node's stochastic rounding uses PRNG
tensor ids rid * 16 + j (see mexc.mx.SITES_PER_NODE); -1 means the op does not round.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mexc.ir import Op

AttrValue = int | bool | str | float | tuple[int, ...] | None

_CONV: dict[str, AttrValue] = {"stride": (1, 1), "padding": (0, 0), "groups": 1, "has_bias": False}
_POOL: dict[str, AttrValue] = {"kernel": (2, 2), "stride": (2, 2), "padding": (0, 0)}
_CAP: dict[str, AttrValue] = {"shift_cap": None, "pre_shift": 0}

SCHEMA: dict[Op, dict[str, AttrValue]] = {
    Op.INPUT: {"name": "x"},
    Op.LABEL: {"name": "y", "num_classes": 0},
    Op.PARAM: {"name": "", "role": "weight"},
    Op.STATE: {"name": "", "role": "velocity", "owner": ""},
    Op.QUANTIZE: {"bits": 8},
    Op.CONV2D: {**_CONV, **_CAP},
    Op.LINEAR: {"has_bias": False, **_CAP},
    Op.COMPACT: {"bits": 8, "rid": -1},
    Op.CONV2D_COMPACT: {**_CONV, **_CAP, "bits": 8, "rid": -1},
    Op.LINEAR_COMPACT: {"has_bias": False, **_CAP, "bits": 8, "rid": -1},
    Op.BATCHNORM: {"eps": 1e-5, "momentum": 0.1, "rid": -1},
    Op.RELU: {},
    Op.RELU6: {},
    Op.MAXPOOL2D: dict(_POOL),
    Op.AVGPOOL2D: {**_POOL, "rid": -1},
    Op.GLOBAL_AVGPOOL: {"rid": -1},
    Op.ADD: {"rid": -1, "shift_cap": None},
    Op.RESHAPE: {"shape": ()},
    Op.DROPOUT: {"p": 0.5, "rid": -1},
    Op.SOFTMAX_CE: {"num_classes": 0, "rid": -1},
    Op.SOFTMAX_CE_GRAD: {"rid": -1},
    Op.LAYERNORM: {"eps": 1e-5, "rid": -1},
    Op.GELU: {"rid": -1},
    Op.SOFTMAX: {"rid": -1},
    Op.MATMUL: {"rid": -1, **_CAP},
    Op.SCALE: {"value": 1.0, "rid": -1},
    Op.TRANSPOSE: {"perm": ()},
    Op.SLICE: {"dim": 0, "start": 0, "stop": 0},
    Op.ADD_PARAM: {"rid": -1},
    Op.MEAN_TOKENS: {"rid": -1},
    Op.LAYERNORM_GRAD: {"rid": -1},
    Op.GELU_GRAD: {"rid": -1},
    Op.SOFTMAX_GRAD: {"rid": -1},
    Op.MATMUL_GRAD: {"rid": -1, **_CAP},
    Op.SCALE_GRAD: {"value": 1.0, "rid": -1},
    Op.SLICE_GRAD: {"dim": 0, "start": 0, "stop": 0},
    Op.ADD_PARAM_GRAD: {},
    Op.MEAN_TOKENS_GRAD: {"rid": -1},
    Op.CONV2D_GRAD_INPUT: {**_CONV, **_CAP, "rid": -1},
    Op.CONV2D_GRAD_WEIGHT: {**_CONV, **_CAP, "rid": -1},
    Op.LINEAR_GRAD_INPUT: {**_CAP, "rid": -1},
    Op.LINEAR_GRAD_WEIGHT: {**_CAP, "rid": -1},
    Op.BIAS_GRAD: {"axes": (0,)},
    Op.BATCHNORM_GRAD: {"rid": -1},
    Op.RELU_GRAD: {},
    Op.RELU6_GRAD: {},
    Op.MAXPOOL2D_GRAD: {**_POOL, "rid": -1},
    Op.AVGPOOL2D_GRAD: {**_POOL, "rid": -1},
    Op.GLOBAL_AVGPOOL_GRAD: {"rid": -1},
    Op.DROPOUT_GRAD: {"p": 0.5, "rid": -1},
    Op.GRAD_SUM: {"rid": -1, "shift_cap": None},
    Op.SGD_UPDATE: {"param": "", "groups": 1, "rid": -1},
    Op.BN_RUNNING_UPDATE: {"momentum": 0.1, "rid": -1},
}


def _class_name(op: Op) -> str:
    return "".join(part.capitalize() for part in op.value.split("_")) + "Attrs"


def _make(op: Op, fields: dict[str, AttrValue]) -> type:
    spec = [(k, Any, dataclasses.field(default=v)) for k, v in fields.items()]
    return dataclasses.make_dataclass(_class_name(op), spec, frozen=True)


ATTRS: dict[Op, type] = {op: _make(op, fields) for op, fields in SCHEMA.items()}


def attrs(op: Op, **values: Any) -> Any:
    """Construct the attribute dataclass of `op`; unknown names are an error."""
    unknown = set(values) - set(SCHEMA[op])
    if unknown:
        raise TypeError(f"op {op.value} has no attribute(s) {sorted(unknown)}")
    cleaned = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return ATTRS[op](**cleaned)


def attr_items(op: Op, value: Any) -> list[tuple[str, AttrValue]]:
    """(name, value) pairs of an attribute dataclass, in schema order."""
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]


def with_attrs(op: Op, value: Any, **changes: Any) -> Any:
    return dataclasses.replace(value, **changes)


# ops that multiply mantissas into an int32 accumulator
PRODUCT_OPS = frozenset(
    {
        Op.CONV2D,
        Op.LINEAR,
        Op.CONV2D_COMPACT,
        Op.LINEAR_COMPACT,
        Op.CONV2D_GRAD_INPUT,
        Op.CONV2D_GRAD_WEIGHT,
        Op.LINEAR_GRAD_INPUT,
        Op.LINEAR_GRAD_WEIGHT,
        Op.MATMUL,
        Op.MATMUL_GRAD,
    }
)
BOUNDARY_OPS = frozenset({Op.INPUT, Op.LABEL, Op.PARAM, Op.STATE})
