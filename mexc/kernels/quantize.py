"""Boundary quantization: host float -> MX (the only kernel allowed float arithmetic)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mexc.mx import MX
from mexc.numerics import channel_frame, qmax

# elements quantized at a time (quantize): its float64 temporaries (four of 128 KiB) are a
# fixed cost, not one that grows with the batch until it reaches a block (at 1 << 16, 2 MiB of
# them were 2.1 KiB of the digits CNN's 8.1 KiB peak RSS per sample between batch 32 and 1024)
QUANTIZE_BLOCK = 1 << 14


def quantize(x: np.ndarray, bits: int = 8, agree: Callable[[float], float] | None = None) -> MX:
    """Per-tensor quantization of a float array at the model boundary.

    e = smallest integer with max|x| <= qmax * 2^e (e = 0 for an all-zero tensor);
    m = round-half-away-from-zero(x / 2^e). Raises ValueError on NaN or inf. `agree`: the
    maximum of max|x| over every data-parallel worker's rows (x holds this worker's).
    """
    # in blocks of QUANTIZE_BLOCK elements: the float64 temporaries of the whole batch were a
    # third of the per-sample peak RSS of a compiled FashionCNN step; each element's result is
    # the same
    xv = np.asarray(x)
    flat = xv.reshape(-1)
    blocks = [flat[i : i + QUANTIZE_BLOCK] for i in range(0, flat.size, QUANTIZE_BLOCK)]
    amax = 0.0
    for blk in blocks:
        b = blk.astype(np.float64)
        if not np.all(np.isfinite(b)):
            raise ValueError("quantize: input contains NaN or inf")
        amax = max(amax, float(np.abs(b).max()))
    if agree is not None:
        amax = agree(amax)
    q = qmax(bits)
    if amax == 0.0:
        return MX.of(np.zeros(xv.shape, np.int8), 0)
    e = math.ceil(math.log2(amax / q))
    # ldexp, not 2.0**-e: an exponent past ±1023 (float64 inputs near 1e-307) is exact there
    while amax > math.ldexp(q, e):
        e += 1
    while amax <= math.ldexp(q, e - 1):
        e -= 1
    m = np.empty(flat.size, np.int8)
    for i, blk in zip(range(0, flat.size, QUANTIZE_BLOCK), blocks):
        b = blk.astype(np.float64)
        scaled = np.floor(np.ldexp(np.abs(b), -e) + 0.5)
        m[i : i + b.size] = np.clip(np.sign(b) * scaled, -q, q)
    return MX.of(m.reshape(xv.shape), e)


def quantize_channels(x: np.ndarray, bits: int) -> MX:
    """Boundary quantization with channel exponents (docs/numerics.md §5): each row r of the
    (G, -1) reshape gets e_r = quantize's exponent of that row; the tensor's frame is
    F = max e_r - (8 - B), and m = round(x / 2^t_r) << (t_r - F) with t_r = max(e_r, F)."""
    xv = np.asarray(x, dtype=np.float64)
    if xv.ndim == 0 or bits >= 8:
        return quantize(x, bits)
    rows = [quantize(r, bits) for r in xv.reshape(xv.shape[0], -1)]
    live = np.array([np.any(r.m) for r in rows])
    if not np.any(live):
        return quantize(x, bits)
    frame, ts = channel_frame(np.array([int(r.e) for r in rows], np.int64), live, bits)
    q = qmax(bits)
    out = np.empty((len(rows), xv[0].size), np.int8)
    for i, (row, t) in enumerate(zip(xv.reshape(xv.shape[0], -1), ts.tolist())):
        scaled = np.clip(np.sign(row) * np.floor(np.ldexp(np.abs(row), -t) + 0.5), -q, q)
        out[i] = (scaled.astype(np.int64) << (t - frame)).astype(np.int8)
    return MX.of(out.reshape(xv.shape), frame)
