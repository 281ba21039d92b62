"""Lookup tables: GELU's Phi, GELU', exp."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx

TABLES = [
    (nx.GELU_PHI_TABLE, nx.gelu_phi_float, 0.4),  # (table, f, Lipschitz bound of f on its range)
    (nx.GELU_GRAD_TABLE, nx.gelu_grad_float, 0.8),
    (nx.EXP_TABLE, lambda v: math.exp(min(v, 0.0)), 1.0),
]


def test_table_exponents() -> None:
    assert (nx.GELU_PHI_TABLE.in_exp, nx.GELU_PHI_TABLE.out_exp) == (-5, -15)
    assert (nx.GELU_GRAD_TABLE.in_exp, nx.GELU_GRAD_TABLE.out_exp) == (-5, -14)
    assert (nx.EXP_TABLE.in_exp, nx.EXP_TABLE.out_exp) == (-4, -15)
    for t, _, _ in TABLES:
        assert t.values.shape == (256,) and t.values.dtype == np.int32
        assert t.values.min() >= t.lo and t.values.max() <= t.hi
    assert int(nx.EXP_TABLE.values[128]) == 2**15  # exp(0) = 1


@pytest.mark.parametrize("idx", range(3))
def test_grid_points_within_half_unit(idx: int) -> None:
    t, f, _ = TABLES[idx]
    x = np.arange(-128, 128)
    got = t.lookup(x, t.in_exp, "nearest")
    want = np.array([f(float(i) * 2.0**t.in_exp) / 2.0**t.out_exp for i in x])
    unclamped = (want >= t.lo) & (want <= t.hi)
    assert unclamped.mean() > 0.9
    assert np.all(np.abs(got[unclamped] - want[unclamped]) <= 0.5)


@pytest.mark.parametrize("idx", range(2))
@pytest.mark.parametrize("rounding", nx.ROUNDINGS)
def test_fine_inputs_within_one_index_step(idx: int, rounding: nx.Rounding) -> None:
    """Inputs at a finer exponent: index rounding adds at most L * 2^in_exp (nearest: half)."""
    t, f, lip = TABLES[idx]
    e_in = t.in_exp - 4
    x = np.arange(-128 * 16, 127 * 16 + 1)
    got = t.lookup(x, e_in, rounding, key=11)
    want = np.array([f(float(v) * 2.0**e_in) / 2.0**t.out_exp for v in x])
    step = 0.5 if rounding == "nearest" else 1.0
    bound = 0.5 + lip * step * 2.0 ** (t.in_exp - t.out_exp)
    assert np.all(np.abs(got - want) <= bound + 1e-9)


@given(x=st.integers(-(2**20), 2**20), e=st.integers(-12, 3))
def test_index_clamped_and_coarse_inputs(x: int, e: int) -> None:
    t = nx.GELU_PHI_TABLE
    got = int(t.lookup(np.array([x]), e, "nearest")[0])
    v = x * 2.0**e
    idx = min(127, max(-128, math.floor(v * 32 + 0.5)))
    if e > t.in_exp:  # coarser input: exact (saturating) left shift
        idx = min(127, max(-128, x * 2 ** (e - t.in_exp)))
    assert got == int(t.values[idx + 128])


def test_lookup_examples() -> None:
    # docs/numerics.md, lookup table examples
    x = np.array([-64, -16, 0, 16, 32, 64])
    phi = nx.GELU_PHI_TABLE.lookup(x, -5, "nearest").tolist()
    assert phi == [745, 10110, 16384, 22658, 27569, 32023]
    x7 = np.array([-100, 0, 40, 100])
    assert nx.GELU_PHI_TABLE.lookup(x7, -7, "nearest").tolist() == [7121, 16384, 20404, 25647]
    xe = np.array([-128, -16, -1, 0])
    assert nx.EXP_TABLE.lookup(xe, -4, "nearest").tolist() == [11, 12055, 30783, 32768]
