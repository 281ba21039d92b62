"""Random models from the supported op set compile, verify and train without overflow.

The generator is bench/fuzz_models.py's, shared with the campaign bench/fuzz.py: hypothesis
draws small models (`SMALL`, shrinking a failure), and a short fixed-seed campaign draws from the
campaign's own wide distribution (`WIDE`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bench.fuzz_models import FAILURES, SMALL, Case, campaign, random_case, run_case

T = TypeVar("T")


class _HypothesisDraw:
    """bench.fuzz_models.Draw over hypothesis's draw."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return random_case(_HypothesisDraw(draw), SMALL)


@st.composite
def models(draw: st.DrawFn) -> nn.Module:
    """A SMALL model for a (N, 1, 8, 8) input and 10 classes (tests/codegen/test_llvm_step.py)."""
    return random_case(_HypothesisDraw(draw), SMALL).model


@settings(max_examples=15, deadline=None)
@given(case=cases())
def test_random_models_train_without_overflow(case: Case) -> None:
    out = run_case(case, steps=2)
    assert out.kind == "compiled", f"{out.kind}: {out.message} ({out.where}) -- {case.summary()}"


@pytest.mark.parametrize("seed", [29])
def test_short_campaign_of_wide_models(seed: int) -> None:
    """40 models of the campaign's distribution (batches 2-64, input scales 0 and 1e-4..1e3,
    B = 4/6/8, batch norm in most): none crashes, overflows, loses a finite loss or differs
    between the checked and the fast reference paths."""
    result = campaign(seed, models=40)
    assert result.models == 40
    bad = {k: result.counts[k] for k in FAILURES if result.counts[k]}
    assert not bad, (bad, result.findings[:3])
    assert result.counts["compiled"] >= 36, result.refusals
