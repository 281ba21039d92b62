"""Linear attention written as timm's EfficientViT writes it: the values padded with a column of
ones (F.pad with value 1.0: zero padding plus a constant), a branch on the tensor's device (the
CPU's way: mexc runs the float model there), and the numerators divided by the last column
(`div`, broadcast). The feature map is elu(x) + 1 ("Transformers are RNNs"), whose divisors
stay within a few times of each other: EfficientViT's ReLU lets a row's divisor fall to
1/1000 of the tensor's largest, which one int8 exponent cannot hold (docs/layers.md, "Quotient
of two tensors"). Against torch and autograd, bit-exact on reference, llvm and C."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    small_batch,
)


class LinearAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 64]
        t = x.view(-1, 8, 8)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        q, k = F.elu(q) + 1.0, F.elu(k) + 1.0
        v = F.pad(v, (0, 1), mode="constant", value=1.0)  # [N, 8, 9]
        if v.device.type != "meta":  # timm's branch (around an autocast)
            vk = torch.matmul(k.transpose(-1, -2), v)  # [N, 8, 9]
        else:
            vk = torch.matmul(k.transpose(-1, -2), v) * 2.0
        out = torch.matmul(q, vk)  # [N, 8, 9]
        out = out[..., :-1] / (out[..., -1:] + 1e-3)
        return self.head(out.mean(1))


def _model() -> LinearAttention:
    torch.manual_seed(0)
    return LinearAttention()


def test_the_padding_is_zeros_plus_a_constant_and_the_quotient_a_div() -> None:
    prog = mexc.compile(_model(), (torch.zeros(4, 64),), target="reference")
    ops = [n.op for n in prog.graph.nodes]
    assert ops.count(Op.PAD) == 1 and ops.count(Op.GATHER_PARAM) == 1
    assert ops.count(Op.DIV) >= 1
    # the CPU's branch: no scale by 2.0
    assert not [n for n in prog.graph.nodes if n.op is Op.SCALE and n.attrs.value == 2.0]


def test_logits_match_torch() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(8, 64),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 64))[0])


def test_gradients_follow_autograd() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(32, 64),))
    x, y = small_batch((32, 64))
    assert_gradients_follow_autograd(model, prog, x, y, ("qkv.weight", "head.weight"), 0.95)


def test_trains_bit_exact_on_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        return mexc.compile(_model(), (torch.zeros(4, 64),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, small_batch((4, 64)))
