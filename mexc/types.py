"""Value types of the mexc IR and their text form.

f32[128,1,28,28]            float tensor (only before insert-mx-types, and at the boundary)
i64[128]                    integer labels
mx<i8,e=tensor>[16,1,3,3]   B-bit mantissas in int8, one exponent per tensor
mx<i8,e=axis0>[16,1,3,3]    one exponent per slice along axis 0 (output channel / neuron)
acc<i32,e=tensor>[128,10]   int32 accumulator with an exponent, before compaction
i16[128,10]                 softmax probabilities in int16 at a fixed exponent (-15)
idx[128,16,14,14]           integer indices (max-pool argmax, dropout mask)
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(enum.Enum):
    F32 = "f32"
    I64 = "i64"
    MX = "mx"
    ACC = "acc"
    I16 = "i16"
    IDX = "idx"


class Exp(enum.Enum):
    TENSOR = "tensor"
    AXIS0 = "axis0"


_ELEM = {Kind.MX: "i8", Kind.ACC: "i32"}


@dataclass(frozen=True)
class TensorType:
    kind: Kind
    shape: tuple[int, ...]
    exp: Exp | None = None  # only for MX and ACC

    def __post_init__(self) -> None:
        needs_exp = self.kind in (Kind.MX, Kind.ACC)
        if needs_exp != (self.exp is not None):
            raise ValueError(
                f"{self.kind.value} type {'needs' if needs_exp else 'has no'} exponent"
            )

    @property
    def is_float(self) -> bool:
        return self.kind is Kind.F32

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def with_shape(self, shape: tuple[int, ...]) -> TensorType:
        return TensorType(self.kind, tuple(shape), self.exp)

    def __str__(self) -> str:
        dims = "[" + ",".join(str(d) for d in self.shape) + "]"
        if self.exp is None:
            return f"{self.kind.value}{dims}"
        return f"{self.kind.value}<{_ELEM[self.kind]},e={self.exp.value}>{dims}"


def f32(*shape: int) -> TensorType:
    return TensorType(Kind.F32, tuple(shape))


def mx(*shape: int, exp: Exp = Exp.TENSOR) -> TensorType:
    return TensorType(Kind.MX, tuple(shape), exp)


def acc(*shape: int, exp: Exp = Exp.TENSOR) -> TensorType:
    return TensorType(Kind.ACC, tuple(shape), exp)


_TYPE_RE = re.compile(r"^(\w+)(?:<(\w+),e=(\w+)>)?\[([0-9,]*)\]$")


def parse_type(text: str) -> TensorType:
    """Inverse of str(TensorType)."""
    m = _TYPE_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a mexc type: {text!r}")
    kind = Kind(m.group(1))
    if m.group(2) is not None and m.group(2) != _ELEM.get(kind):
        raise ValueError(f"bad element type in {text!r}")
    exp = Exp(m.group(3)) if m.group(3) else None
    dims = tuple(int(d) for d in m.group(4).split(",") if d)
    return TensorType(kind, dims, exp)
