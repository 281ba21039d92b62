import pytest

from mexc.ops import op_def
from mexc.passes.plan_memory import plan, type_bytes
from mexc.types import acc, mx
from tests.passes.golden_util import CASES, check_golden, context, graph_before, run_pass

PASS = "plan-memory"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    after = run_pass(PASS, graph_before(case, PASS))
    check_golden(case, PASS, after)


def test_type_bytes() -> None:
    assert type_bytes(mx(16, 8, 3, 3)) == 16 * 8 * 9 + 4
    assert type_bytes(mx(16, 8, 3, 3, exp=__import__("mexc.types").types.Exp.AXIS0)) == 1152 + 64
    assert type_bytes(acc(10)) == 44


def test_plan_is_consistent() -> None:
    g = graph_before("digits_cnn", PASS)
    mp = plan(g)
    arena = [s for s in mp.slots if s.kind != "persistent"]
    # no two simultaneously live values overlap in the arena
    for i, a in enumerate(arena):
        for b in arena[i + 1 :]:
            if (
                a.alias_of == b.value
                or b.alias_of == a.value
                or (a.alias_of is not None and a.alias_of == b.alias_of)
            ):
                continue  # computed in place: sharing bytes is the point
            live_together = not (a.end < b.start or b.end < a.start)
            overlap = a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
            assert not (live_together and overlap), (a, b)
    assert mp.arena_bytes <= sum(s.nbytes for s in arena)
    in_place = [s for s in arena if s.alias_of is not None]
    assert in_place, "relu after BN should be computed in place"
    ops = {n.id: op_def(n.op) for n in g.nodes}
    for s in in_place:  # over a dead input, or a view (a reshape) beside a live one
        root = next(r for r in arena if r.value == s.alias_of)
        assert root.end <= s.start or ops[s.value.node].view, s
    assert any(
        ops[s.value.node].view and s.start < next(r for r in arena if r.value == s.alias_of).end
        for s in in_place
    ), "the flatten before the classifier is a view of a live value"
    assert mp.arena_bytes >= max(s.nbytes for s in arena)
    assert mp.saved_bytes > 0 and mp.persistent_bytes > 0
    ctx = context()
    run_pass(PASS, g)
    assert ctx is not None
