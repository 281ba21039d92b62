"""rematerialize: batch-norm outputs recomputed for the backward pass, the same bits, fewer saved
bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.ir import Graph, Op
from mexc.verify import verify
from tests.passes.golden_util import CASES, check_golden, graph_before, run_pass

PASS = "rematerialize"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    after = run_pass(PASS, graph_before(case, PASS))
    verify(after, PASS, integer_only=True, caps_assigned=True)
    check_golden(case, PASS, after)


class _Net(nn.Module):
    """conv-BN-ReLU, conv-BN straight into a conv, conv-BN into a residual sum, ReLU6."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.c3, self.b3 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.c4, self.b4 = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.c5, self.b5 = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.b1(self.c1(x)))
        b = self.b2(self.c2(a))  # read by c3 straight: recomputed without an activation
        c = torch.relu(self.b3(self.c3(b)) + a)  # b3 only feeds the sum: kept as it is
        d = nn.functional.relu6(self.b4(self.c4(c)))
        # b5's ReLU output is flattened for fc, whose weight gradient reads that view: kept
        e = torch.relu(self.b5(self.c5(d)))
        return self.fc(e.flatten(1))


def _batch(n: int = 6) -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 6, 6, generator=g), np.arange(n) % 5


def _recomputed(g: Graph) -> dict[int, list[Op]]:
    """batch norm rid -> the ops that read its recomputed output."""
    users = g.users()
    out: dict[int, list[Op]] = {}
    for n in g.nodes_of(Op.BATCHNORM_AFFINE):
        readers = [u.op for u in users[n.out]]
        if readers in ([Op.RELU], [Op.RELU6]):
            readers += [u.op for u in users[users[n.out][0].out]]
        out[int(n.attrs.rid)] = sorted(readers, key=lambda o: o.value)
    return out


def test_the_backward_pass_reads_recomputed_outputs_only() -> None:
    torch.manual_seed(0)
    x, _ = _batch()
    g = mexc.compile(_Net(), (x,)).graph
    bn_rid = {n.loc: int(n.attrs.rid) for n in g.nodes_of(Op.BATCHNORM)}
    rids = sorted(bn_rid.values())
    got = _recomputed(g)
    # b1 (ReLU: mask, c2's weight gradient), b2 (c3's weight gradient), b4 (ReLU6: mask, c5's
    # weight gradient); b3 feeds only the sum, b5's ReLU output lives on in its flattened view
    assert sorted(got) == [rids[0], rids[1], rids[3]]
    assert got[rids[0]] == [Op.CONV2D_GRAD_WEIGHT, Op.RELU, Op.RELU_GRAD]
    assert got[rids[1]] == [Op.CONV2D_GRAD_WEIGHT]
    assert got[rids[3]] == [Op.CONV2D_GRAD_WEIGHT, Op.RELU6, Op.RELU6_GRAD]
    # no forward batch-norm output or ReLU of one is read after the loss gradient any more
    start = next(i for i, n in enumerate(g.nodes) if n.op is Op.SOFTMAX_CE_GRAD)
    late = {v for n in g.nodes[start:] for v in n.inputs}
    for bn in g.nodes_of(Op.BATCHNORM):
        assert bn.out not in late
    relus = [n for n in g.nodes[:start] if n.op in (Op.RELU, Op.RELU6)]
    kept = [n for n in relus if n.out in late and g.node(n.inputs[0].node).op is Op.BATCHNORM]
    assert [int(g.node(n.inputs[0].node).attrs.rid) for n in kept] == [rids[4]]


@pytest.mark.parametrize("bits,rounding", [(8, "stochastic"), (6, "nearest-forward")])
def test_recomputing_keeps_every_bit_and_saves_bytes(bits: int, rounding: str) -> None:
    torch.manual_seed(0)
    net = _Net()
    x, y = _batch()
    on = mexc.compile(net, (x,), bits=bits, rounding=rounding)
    off = mexc.compile(net, (x,), bits=bits, rounding=rounding, recompute=False)
    assert not off.graph.nodes_of(Op.BATCHNORM_AFFINE)
    for _ in range(3):
        assert on.step(x, y) == off.step(x, y)
    assert on.state_checksum() == off.state_checksum()
    # the ReLU outputs of b1 and b4 and b2's output: 6 x 4 x 6 x 6 int8 each, while they are
    # no longer kept across the loss
    on_arena = on.memory_report()["planned_arena_bytes"]
    off_arena = off.memory_report()["planned_arena_bytes"]
    assert on_arena < off_arena


@pytest.mark.parametrize("target", ["llvm", "c"])
def test_recomputed_outputs_are_bit_exact_on_the_backends(target: str) -> None:
    pytest.importorskip("tvm") if target == "llvm" else None
    torch.manual_seed(0)
    net = _Net()
    x, y = _batch()
    # with channel exponents (on by default below 8 bits): the copy rounds with the forward's
    # channel shifts
    opts = {"rounding": "nearest-forward", "bits": 6, "channel_exponents": True}
    ref = mexc.compile(net, (x,), **opts)
    other = mexc.compile(net, (x,), target=target, **opts)
    assert other.graph.nodes_of(Op.BATCHNORM_AFFINE)
    for _ in range(3):
        ref.step(x, y)
        other.step(x, y)
        assert other.state_checksum() == ref.state_checksum()


@pytest.mark.parametrize("bits,rounding", [(8, "stochastic"), (6, "nearest-forward")])
def test_norms_computed_again_keep_every_bit_and_save_bytes(bits: int, rounding: str) -> None:
    """rematerialize.recompute_norms (the C step's choice): the first convolution and its batch
    norm again in the backward pass, so that its xhat is not kept across the loss."""
    from mexc.passes.plan_memory import plan
    from mexc.passes.rematerialize import recomputable_norms, recompute_norms
    from mexc.program import Program

    torch.manual_seed(0)
    x, y = _batch()
    base = mexc.compile(_Net(), (x,), bits=bits, rounding=rounding)
    norms = recomputable_norms(base.graph)
    # b1 (its convolution reads the batch, which c1's weight gradient keeps anyway) and b4
    # (c4 reads the sum, which c4's weight gradient keeps); not b2, b3 and b5, whose
    # convolutions read recomputed outputs
    rids = sorted(int(n.attrs.rid) for n in base.graph.nodes_of(Op.BATCHNORM))
    assert sorted(int(n.attrs.rid) for n in norms) == [rids[0], rids[3]]
    g = recompute_norms(base.graph, norms)
    verify(g)
    assert len(g.nodes_of(Op.BATCHNORM)) == len(base.graph.nodes_of(Op.BATCHNORM)) + len(norms)
    again = Program(g, dict(base.state), base.options, base.optimizer, base.step_count)
    for _ in range(3):
        assert again.step(x, y) == base.step(x, y)
    assert again.state_checksum() == base.state_checksum()
    assert plan(g).saved_bytes < plan(base.graph).saved_bytes
