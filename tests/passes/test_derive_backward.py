import pytest

from mexc.ir import Op
from mexc.verify import verify
from tests.passes.golden_util import CASES, check_golden, graph_before, run_pass

PASS = "derive-backward"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    after = run_pass(PASS, graph_before(case, PASS))
    verify(after, PASS, integer_only=True, caps_assigned=True)
    check_golden(case, PASS, after)


def test_every_parameter_gets_a_gradient() -> None:
    before = graph_before("digits_cnn", PASS)
    after = run_pass(PASS, before)
    params = {n.attrs.name for n in before.nodes_of(Op.PARAM)}
    grads = {name[5:] for name, _ in after.outputs if name.startswith("grad:")}
    assert grads == params
    # no gradient is computed for the quantized input
    first_conv = before.nodes_of(Op.CONV2D_COMPACT)[0]
    assert all(n.inputs[0] != first_conv.out for n in after.nodes_of(Op.CONV2D_GRAD_INPUT))


def test_residual_fanout_gets_grad_sum() -> None:
    import sys

    import torch

    from examples.models import SmallResNet
    from mexc.frontend import import_model
    from mexc.pipeline import PIPELINE
    from tests.passes.golden_util import ROOT, context

    sys.path.insert(0, str(ROOT))
    g = import_model(SmallResNet(), torch.zeros(2, 1, 28, 28)).graph
    ctx = context()
    for p in PIPELINE[:4]:
        g = p.fn(g, ctx)
    sums = g.nodes_of(Op.GRAD_SUM)
    assert len(sums) == 3  # one per residual block input
    assert all(n.attrs.shift_cap is not None for n in sums)
