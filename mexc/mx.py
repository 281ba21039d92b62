"""The mantissa-exponent tensor value and the rounding context shared by all reference kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mexc.numerics import Rounding, expand_exponent, stream_key

SITES_PER_NODE = 16  # rounding-site tensor ids reserved per IR node: tid, tid + 1, ..., tid + 15


@dataclass(frozen=True)
class MX:
    """value = m * 2^e. m: int8 mantissas; e: int64 exponent, shape () or (G,) along axis 0."""

    m: np.ndarray
    e: np.ndarray

    @staticmethod
    def of(m: np.ndarray, e: np.ndarray | int) -> MX:
        return MX(np.asarray(m, dtype=np.int8), np.asarray(e, dtype=np.int64))

    @property
    def grouped(self) -> bool:
        return self.e.ndim == 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.m.shape)

    def dequantize(self) -> np.ndarray:
        """float64 value (host-side tests and logging only)."""
        return np.ldexp(self.m.astype(np.float64), expand_exponent(self.e, self.m.ndim))

    def ordered(self) -> np.ndarray:
        """float64 values over 2^max(e): in the order of the values, finite at any exponent
        (dequantize overflows to inf, or underflows to 0, past float64's range)."""
        return _over_largest(self.m, self.e)


@dataclass(frozen=True)
class Acc:
    """An int32 accumulator (held in int64 arrays) with an exponent, before compaction."""

    a: np.ndarray
    e: np.ndarray

    def dequantize(self) -> np.ndarray:
        return np.ldexp(self.a.astype(np.float64), expand_exponent(self.e, self.a.ndim))

    def ordered(self) -> np.ndarray:
        """As MX.ordered."""
        return _over_largest(self.a, self.e)


def _over_largest(m: np.ndarray, e: np.ndarray | int) -> np.ndarray:
    e64 = np.asarray(e, np.int64)
    top = int(e64.max()) if e64.size else 0
    return np.ldexp(np.asarray(m, np.float64), expand_exponent(e64 - top, np.ndim(m)))


class Collectives(Protocol):
    """What data-parallel workers agree through (mexc.distributed): element-wise integer
    reductions over every worker, the same result on each. all_sum's operands and result are
    int32 values (accumulators the caps bound); all_max takes any int64; all_gather int32."""

    def all_sum(self, a: np.ndarray) -> np.ndarray: ...

    def all_max(self, a: np.ndarray) -> np.ndarray: ...

    def all_gather(self, a: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Rows:
    """This worker's rows of a batch split over data-parallel workers (docs/numerics.md §16):
    global rows start .. start + count - 1 of `total`. A kernel over batch-major arrays takes
    every per-tensor decision from all workers' values through `comm`, and indexes the PRNG by
    global element."""

    start: int
    count: int
    total: int
    comm: Collectives

    def offset(self, a: np.ndarray | tuple[int, ...]) -> int:
        """Global flat index of local element 0 of batch-major `a` (or an array of that shape):
        its rows are `count` equal slices of the leading axis (N, or N * tokens)."""
        size = int(np.prod(a if isinstance(a, tuple) else np.shape(a), dtype=np.int64))
        return self.start * (size // self.count)

    def max_float(self, amax: float) -> float:
        """The maximum over the workers of a non-negative float (a batch's max |x| at the float
        boundary): its float64 bits, read as an int64, order as the floats do."""
        bits = np.asarray(amax, np.float64).view(np.int64)
        return float(np.asarray(self.max(bits), np.int64).view(np.float64))

    def width(self, local: int) -> int:
        """The global extent of a batch-major axis of `local` elements here."""
        return local // self.count * self.total

    def max(self, v: np.ndarray | int) -> np.ndarray:
        """Element-wise maximum over the workers."""
        return self.comm.all_max(np.asarray(v, np.int64))

    def sum(self, v: np.ndarray | int) -> np.ndarray:
        """Element-wise sum over the workers (int32 values: the caps bound every batch sum)."""
        return self.comm.all_sum(np.asarray(v, np.int64))


@dataclass(frozen=True)
class RoundCtx:
    """How a training step rounds: mode, seed and step feed the counter-based PRNG. `rows`: the
    worker's share of the batch in a data-parallel step (None: the whole batch is here)."""

    rounding: Rounding
    seed: int = 0
    step: int = 0
    bits: int = 8
    rows: Rows | None = None
    channels: bool = False  # channel exponents of activations and gradients (numerics §5)

    def key(self, tid: int) -> int:
        """Key of rounding site `tid` (a node's base tid plus a site number < SITES_PER_NODE)."""
        return stream_key(self.seed, self.step, tid)
