import pytest

from mexc.ir import Op
from mexc.types import Kind
from mexc.verify import verify
from tests.passes.golden_util import CASES, check_golden, graph_before, run_pass

PASS = "insert-mx-types"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    after = run_pass(PASS, graph_before(case, PASS))
    verify(after, PASS, integer_only=True)
    check_golden(case, PASS, after)


def test_only_boundary_and_loss_stay_float() -> None:
    after = run_pass(PASS, graph_before("digits_cnn", PASS))
    floats = [(n.op, i) for n in after for i, t in enumerate(n.types) if t.kind is Kind.F32]
    assert floats == [(Op.INPUT, 0), (Op.SOFTMAX_CE, 1)]
    assert len(after.nodes_of(Op.QUANTIZE)) == 1
    rids = [n.attrs.rid for n in after if hasattr(n.attrs, "rid")]
    assert len(rids) == len(set(rids)) and min(rids) == 0


def test_products_get_explicit_compaction() -> None:
    after = run_pass(PASS, graph_before("mlp", PASS))
    for n in after.nodes_of(Op.LINEAR):
        assert n.type.kind is Kind.ACC
        (user,) = after.users()[n.out]
        assert user.op is Op.COMPACT
