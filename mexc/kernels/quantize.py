"""Boundary quantization: host float -> MX (the only kernel allowed float arithmetic)."""

from __future__ import annotations

import math

import numpy as np

from mexc.mx import MX
from mexc.numerics import qmax


def quantize(x: np.ndarray, bits: int = 8) -> MX:
    """Per-tensor quantization of a float array at the model boundary.

    e = smallest integer with max|x| <= qmax * 2^e (e = 0 for an all-zero tensor);
    m = round-half-away-from-zero(x / 2^e). Raises ValueError on NaN or inf.
    """
    xv = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(xv)):
        raise ValueError("quantize: input contains NaN or inf")
    q = qmax(bits)
    amax = float(np.abs(xv).max()) if xv.size else 0.0
    if amax == 0.0:
        return MX.of(np.zeros(xv.shape, np.int8), 0)
    e = math.ceil(math.log2(amax / q))
    while amax > q * 2.0**e:
        e += 1
    while amax <= q * 2.0 ** (e - 1):
        e -= 1
    scaled = np.abs(xv) * 2.0**-e
    m = np.sign(xv) * np.floor(scaled + 0.5)
    return MX.of(np.clip(m, -q, q).astype(np.int8), e)
