"""The mantissa-exponent tensor value and the rounding context shared by all reference kernels."""

from __future__ import annotations

from dataclasses import dataclass

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
        scale = np.exp2(expand_exponent(self.e, self.m.ndim).astype(np.float64))
        return self.m.astype(np.float64) * scale


@dataclass(frozen=True)
class Acc:
    """An int32 accumulator (held in int64 arrays) with an exponent, before compaction."""

    a: np.ndarray
    e: np.ndarray

    def dequantize(self) -> np.ndarray:
        scale = np.exp2(expand_exponent(self.e, self.a.ndim).astype(np.float64))
        return self.a.astype(np.float64) * scale


@dataclass(frozen=True)
class RoundCtx:
    """How a training step rounds: mode, seed and step feed the counter-based PRNG."""

    rounding: Rounding
    seed: int = 0
    step: int = 0
    bits: int = 8

    def key(self, tid: int) -> int:
        """Key of rounding site `tid` (a node's base tid plus a site number < SITES_PER_NODE)."""
        return stream_key(self.seed, self.step, tid)
