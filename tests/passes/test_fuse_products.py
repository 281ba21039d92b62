import pytest

from mexc.ir import Op
from mexc.verify import verify
from tests.passes.golden_util import CASES, check_golden, graph_before, run_pass

PASS = "fuse-products"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    before = graph_before(case, PASS)
    after = run_pass(PASS, before)
    verify(after, PASS, integer_only=True)
    check_golden(case, PASS, after)
    assert not after.nodes_of(Op.COMPACT, Op.CONV2D, Op.LINEAR)
    fused = after.nodes_of(Op.CONV2D_COMPACT, Op.LINEAR_COMPACT)
    assert len(fused) == len(before.nodes_of(Op.CONV2D, Op.LINEAR))
    # the fused op keeps the compaction's rounding site so results stay bit-identical
    compact_rids = sorted(n.attrs.rid for n in before.nodes_of(Op.COMPACT))
    assert sorted(n.attrs.rid for n in fused) == compact_rids


def test_idempotent() -> None:
    once = run_pass(PASS, graph_before("digits_cnn", PASS))
    assert run_pass(PASS, once) == once
