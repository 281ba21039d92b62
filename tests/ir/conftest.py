"""Shared fixtures for the IR tests: one small hand-built training-like graph."""

import pytest

from mexc.ir import Graph, GraphBuilder, Op
from mexc.ops import attrs
from mexc.types import Exp, Kind, TensorType, acc, f32, mx


def build_sample() -> Graph:
    b = GraphBuilder()
    x = b.add(Op.INPUT, [], f32(4, 1, 8, 8), attrs(Op.INPUT, name="x"), loc="train.py:12")
    y = b.add(Op.LABEL, [], TensorType(Kind.I64, (4,)), attrs(Op.LABEL, name="y", num_classes=10))
    w = b.add(Op.PARAM, [], mx(16, 1, 3, 3, exp=Exp.AXIS0), attrs(Op.PARAM, name="conv1.weight"))
    q = b.add(Op.QUANTIZE, [x.out], mx(4, 1, 8, 8), attrs(Op.QUANTIZE, bits=8))
    c = b.add(
        Op.CONV2D_COMPACT,
        [q.out, w.out],
        mx(4, 16, 8, 8),
        attrs(Op.CONV2D_COMPACT, padding=(1, 1), shift_cap=17, rid=4),
        loc="models.py:23",
    )
    r = b.add(Op.RELU, [c.out], mx(4, 16, 8, 8), attrs(Op.RELU))
    bn = b.add(
        Op.BATCHNORM_GRAD,
        [r.out, w.out],
        (mx(4, 16, 8, 8), acc(16), acc(16)),
        attrs(Op.BATCHNORM_GRAD, rid=7),
    )
    ce = b.add(
        Op.SOFTMAX_CE,
        [bn.result(0), y.out],
        (f32(), TensorType(Kind.I16, (4, 10))),
        attrs(Op.SOFTMAX_CE, num_classes=10, rid=8),
    )
    return b.build(
        [("loss", ce.out), ("state:conv1.weight", bn.result(2))],
        [("bits", 8), ("batch", 4)],
    )


@pytest.fixture
def sample() -> Graph:
    return build_sample()
