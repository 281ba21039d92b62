import pytest

from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from mexc.numerics import product_cap
from mexc.ops import with_attrs
from mexc.passes.assign_shift_caps import cap_for
from mexc.types import mx
from mexc.verify import verify
from tests.passes.golden_util import CASES, check_golden, graph_before, run_pass

PASS = "assign-shift-caps"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    after = run_pass(PASS, graph_before(case, PASS))
    verify(after, PASS, integer_only=True, caps_assigned=True)
    check_golden(case, PASS, after)


def test_caps_match_the_spec_formula() -> None:
    after = run_pass(PASS, graph_before("digits_cnn", PASS))
    conv1, conv2 = after.nodes_of(Op.CONV2D_COMPACT)
    assert conv1.attrs.shift_cap == product_cap(1 * 3 * 3, 8) == 31 - (14 + 4)
    assert conv2.attrs.shift_cap == product_cap(8 * 3 * 3, 8) == 31 - (14 + 7)
    (fc,) = after.nodes_of(Op.LINEAR_COMPACT)
    assert fc.attrs.shift_cap == product_cap(256 + 1, 8)  # + bias term
    assert all(n.attrs.pre_shift == 0 for n in (conv1, conv2, fc))


def test_idempotent() -> None:
    once = run_pass(PASS, graph_before("mlp", PASS))
    assert run_pass(PASS, once) == once


def test_negative_cap_pre_shifts_and_hopeless_cap_is_refused() -> None:
    g = run_pass(PASS, graph_before("mlp", PASS))
    (fc, *_) = g.nodes_of(Op.LINEAR_COMPACT)
    wide = {0: mx(4, 1 << 18), 1: mx(10, 1 << 18)}
    node = cap_for(with_attrs(fc.op, fc.attrs) and fc, wide.__getitem__, 8)
    assert node.attrs.shift_cap == product_cap((1 << 18) + 1, 8) < 0
    assert node.attrs.pre_shift == -node.attrs.shift_cap
    huge = {0: mx(4, 1 << 30), 1: mx(10, 1 << 30)}
    with pytest.raises(UnsupportedOpError, match="K=1073741825"):
        cap_for(fc, huge.__getitem__, 8)
