"""ReLU and ReLU6: exponent unchanged, no rounding."""

from __future__ import annotations

import numpy as np

from mexc.kernels._common import i64, scalar_exp
from mexc.mx import MX


def relu_forward(x: MX) -> MX:
    """y = max(m, 0), same exponent."""
    return MX(np.maximum(x.m, 0).astype(np.int8), x.e)


def _mask(x_or_mask: MX | np.ndarray) -> np.ndarray:
    if isinstance(x_or_mask, MX):
        return x_or_mask.m > 0
    return np.asarray(x_or_mask, dtype=bool)


def relu_backward(dy: MX, x_or_mask: MX | np.ndarray) -> MX:
    """dx = dy where x > 0 (x = the ReLU input or output, or a boolean mask), else 0."""
    dm = np.asarray(dy.m)
    if dm.dtype == np.int8:
        mask = _mask(x_or_mask)
        if mask.shape == dm.shape:
            out = np.negative(mask.view(np.int8))  # 0 / -1 (all bits set): a new array
            out &= dm
            return MX(out, dy.e)
    return MX(np.where(_mask(x_or_mask), dy.m, 0).astype(np.int8), dy.e)


def relu6_cap(e: int, qmax_: int = 127) -> int:
    """Largest mantissa c with c * 2^e <= 6, clipped to qmax: min(6 << -e, qmax) for e < 0,
    6 >> e for e >= 0."""
    if e >= 0:
        return min(6 >> min(e, 62), qmax_)
    return min(6 << min(-e, 40), qmax_)


def relu6_forward(x: MX) -> MX:
    """y = clip(m, 0, c) with c = relu6_cap(e); same exponent."""
    e = scalar_exp(x, "relu6 input")
    return MX(np.clip(x.m, 0, relu6_cap(e)).astype(np.int8), x.e)


def relu6_backward(dy: MX, x: MX) -> MX:
    """dx = dy where 0 < x < 6 (x = the ReLU6 input), compared exactly as m * 2^e < 6."""
    e = scalar_exp(x, "relu6 input")
    m = i64(x.m)  # |m| <= 127 < 6 << 5 and 1 << 3 > 6, so shifts of 8 decide every case
    keep = (m > 0) & ((m << min(max(e, 0), 8)) < (6 << min(max(-e, 0), 8)))
    return MX(np.where(keep, dy.m, 0).astype(np.int8), dy.e)
