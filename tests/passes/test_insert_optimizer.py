import pytest

from mexc.ir import Op
from mexc.pass_manager import PassContext
from mexc.passes.insert_optimizer import insert_optimizer
from mexc.types import Exp
from mexc.verify import verify
from tests.passes.golden_util import CASES, check_golden, context, graph_before, run_pass

PASS = "insert-optimizer"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    after = run_pass(PASS, graph_before(case, PASS))
    verify(after, PASS, integer_only=True, caps_assigned=True)
    check_golden(case, PASS, after)


def test_updates_and_state_outputs() -> None:
    after = run_pass(PASS, graph_before("digits_cnn", PASS))
    params = {n.attrs.name for n in after.nodes_of(Op.PARAM)}
    updates = after.nodes_of(Op.SGD_UPDATE)
    assert {n.attrs.param for n in updates} == params
    names = {name for name, _ in after.outputs}
    assert not any(n.startswith("grad:") for n in names)
    for p in params:
        assert f"state:{p}" in names and f"state:{p}.velocity" in names
    assert {"state:bn1.running_mean", "state:bn2.running_var"} <= names
    assert after.attr("momentum") == (29491, 15)


def test_per_group_switch() -> None:
    before = graph_before("mlp", PASS)
    ctx: PassContext = context()
    on = insert_optimizer(before, ctx)
    ctx.per_group_velocity = False
    off = insert_optimizer(before, ctx)
    vel_on = [n for n in on.nodes_of(Op.STATE) if n.attrs.role == "velocity"]
    vel_off = [n for n in off.nodes_of(Op.STATE) if n.attrs.role == "velocity"]
    assert all(n.type.exp is Exp.AXIS0 for n in vel_on)
    assert all(n.type.exp is Exp.TENSOR for n in vel_off)
    assert all(n.attrs.groups == 1 for n in off.nodes_of(Op.SGD_UPDATE))
