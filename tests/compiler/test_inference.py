"""Inference logits keep the classifier's int32 accumulator (docs/numerics.md §15)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import mexc
from mexc.backends.reference.interp import StepEnv, execute
from mexc.kernels import conv2d_accumulate, conv2d_forward, linear_accumulate, linear_forward
from mexc.mx import MX, RoundCtx

# Two classes 127 units apart in the accumulator (32131 vs 32258 at 2^-14) round to the same
# 8-bit mantissa (126 at 2^-6): an argmax over 8-bit logits cannot tell them apart.
W_TIED = np.array([[127, 126], [127, 127], [-127, -127]], np.int8)
X_TIED = np.full((1, 2), 127 / 128)


def _tied_program() -> mexc.Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 3, bias=False))
    prog = mexc.compile(model, (torch.zeros(1, 2),))
    prog.state = dict(prog.state) | {"1.weight": MX.of(W_TIED, -7)}
    return prog


def test_eight_bit_logits_of_the_case_are_tied() -> None:
    prog = _tied_program()
    env = StepEnv(RoundCtx("nearest", 0, 0, 8), False, X_TIED, None, prog.state)
    logits = execute(prog._eval_nodes, env)[prog.graph.output("logits")]
    assert logits.m.tolist() == [[126, 126, -126]] and int(logits.e) == -6


def test_inference_logits_are_the_exact_accumulator() -> None:
    prog = _tied_program()
    assert prog.logits(X_TIED).tolist() == [[32131 / 2**14, 32258 / 2**14, -32258 / 2**14]]
    assert prog.predict(X_TIED).tolist() == [1]
    assert prog.evaluate(X_TIED, np.array([1])) == 1.0


def test_linear_accumulate_then_compaction_is_linear_forward() -> None:
    rng = np.random.default_rng(3)
    x = MX.of(rng.integers(-127, 128, (6, 40)), -5)
    w = MX.of(rng.integers(-127, 128, (7, 40)), -8)
    b = MX.of(rng.integers(-127, 128, (7,)), -4)
    ctx = RoundCtx("stochastic", 1, 2)
    acc = linear_accumulate(x, w, b, ctx, 0)
    exact = x.m.astype(np.int64) @ w.m.astype(np.int64).T  # at 2^-13; the bias is at 2^-4
    assert np.array_equal(acc.dequantize(), (exact * 2.0**-13) + b.m * 2.0**-4)
    y = linear_forward(x, w, b, ctx, 0)
    assert np.abs(y.dequantize() - acc.dequantize()).max() <= 2.0 ** float(y.e)


def test_conv2d_accumulate_is_exact() -> None:
    rng = np.random.default_rng(4)
    x = MX.of(rng.integers(-127, 128, (2, 4, 9, 9)), -6)
    for stride, groups in (((1, 1), 1), ((2, 2), 2)):
        w = MX.of(rng.integers(-127, 128, (6, 4 // groups, 3, 3)), -7)
        ctx = RoundCtx("stochastic", 0, 1)
        acc = conv2d_accumulate(x, w, None, stride, (1, 1), groups, ctx, 0)
        ref = nn.functional.conv2d(
            torch.from_numpy(x.m.astype(np.float64)),
            torch.from_numpy(w.m.astype(np.float64)),
            stride=stride,
            padding=1,
            groups=groups,
        )
        assert np.array_equal(acc.a, ref.numpy().astype(np.int64)) and int(acc.e) == -13
        y = conv2d_forward(x, w, None, stride, (1, 1), groups, ctx, 0)
        assert np.abs(y.dequantize() - acc.dequantize()).max() <= 2.0 ** float(y.e)
