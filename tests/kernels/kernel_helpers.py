"""Shared helpers of the kernel tests (random MX values, torch comparison)."""

from __future__ import annotations

import numpy as np
import torch

from mexc.mx import MX


def rand_mx(rng: np.random.Generator, shape: tuple[int, ...], e: int, lo: int = -127) -> MX:
    return MX.of(rng.integers(lo, 128, shape), e)


def worst_mx(rng: np.random.Generator, shape: tuple[int, ...], e: int) -> MX:
    """All mantissas +-127 (random signs)."""
    return MX.of(np.where(rng.random(shape) < 0.5, -127, 127), e)


def tt(x: MX, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x.dequantize(), dtype=torch.float64, requires_grad=grad)


def cos(a: object, b: object) -> float:
    av = np.ravel(np.asarray(a, dtype=np.float64))
    bv = np.ravel(np.asarray(b, dtype=np.float64))
    return float(av @ bv / (np.linalg.norm(av) * np.linalg.norm(bv) + 1e-300))


def same(a: MX, b: MX) -> bool:
    return bool(np.array_equal(a.m, b.m) and np.array_equal(a.e, b.e))
