"""Normalizations written out with torch ops (mexc.ops.norm_written_out): T5's and LLaMA's
RMSNorm (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), ConvNeXt's channels-first
LayerNorm ((x - u) / torch.sqrt(s + eps)), the Annotated Transformer's LayerNorm
(a_2 * (x - mean) / (std + eps) + b_2) and a variance form, compiled as layer norms. Against
torch and autograd, bit-exact on reference, llvm and C, dead computations dropped, and every
other use of a root refused by node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
    small_batch,
)


class T5Norm(nn.Module):
    """T5's and LLaMA's RMSNorm: the mean square in float32, a weight after."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + 1e-6))


class ChannelsFirstNorm(nn.Module):
    """ConvNeXt's LayerNorm over the channels of (N, C, H, W), with (x - u) written twice."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + 1e-6)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class AnnotatedNorm(nn.Module):
    """The Annotated Transformer's LayerNorm: the unbiased std, eps added to it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(d))
        self.b_2 = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + 1e-6) + self.b_2


class WrittenOutNorms(nn.Module):
    """Each written-out normalization once: channels first after a convolution, then over
    the features of tokens (RMSNorm, the Annotated Transformer's, a variance's reciprocal
    root as a power)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.cf = ChannelsFirstNorm(8)
        self.embed = nn.Linear(8, 16)
        self.rms = T5Norm(16)
        self.mid = nn.Linear(16, 16)
        self.ln = AnnotatedNorm(16)
        self.out = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 1, 8, 8]
        y = torch.relu(self.cf(self.conv(x)))
        t = nn.functional.avg_pool2d(y, 2).flatten(2).transpose(1, 2)  # [N, 16, 8]
        t = self.rms(self.embed(t))
        t = self.ln(torch.relu(self.mid(t)))
        h = self.out(t)
        c = h - h.mean(-1, keepdim=True)
        h = c * (h.var(-1, keepdim=True, unbiased=False) + 1e-5) ** -0.5
        return self.head(h.mean(1))


def _model() -> WrittenOutNorms:
    torch.manual_seed(0)
    return WrittenOutNorms()


def test_each_written_out_normalization_is_one_layer_norm_and_nothing_else() -> None:
    prog = mexc.compile(_model(), (torch.zeros(4, 1, 8, 8),), target="reference")
    forward = [n for n in prog.graph.nodes if prog.graph.is_forward(n)]
    ops = [n.op for n in forward]
    assert ops.count(Op.LAYERNORM) == 4
    # the square, mean and subtraction the roots were written with are not computed: the only
    # means are the token pool's, and no value is squared
    assert ops.count(Op.MEAN_TOKENS) == 1
    assert not [n for n in forward if n.op is Op.MUL and n.inputs[0] == n.inputs[1]]
    # RMSNorm's rows are [v, -v] (twice as wide); the other three are about the mean
    widths = sorted(
        prog.graph.type_of(n.inputs[0]).shape[-1] for n in forward if n.op is Op.LAYERNORM
    )
    assert widths == [8, 16, 16, 32]


def test_logits_match_torch() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((8, 1, 8, 8))[0])


def test_gradients_follow_autograd() -> None:
    model = _model()
    prog = mexc.compile(model, (torch.zeros(32, 1, 8, 8),))
    x, y = small_batch((32, 1, 8, 8))
    assert_gradients_follow_autograd(
        model,
        prog,
        x,
        y,
        ("conv.weight", "cf.weight", "embed.weight", "rms.weight", "ln.a_2", "head.weight"),
        0.95,
    )


def test_trains_bit_exact_on_llvm_and_c() -> None:
    def program(target: str) -> mexc.Program:
        return mexc.compile(_model(), (torch.zeros(4, 1, 8, 8),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program)


def test_a_computation_nothing_reads_is_not_in_the_program() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.aux = nn.Linear(8, 4)
            self.head = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            _ = self.aux(h * h)  # an auxiliary head the training loss does not read
            return self.head(h)

    torch.manual_seed(0)
    prog = mexc.compile(Unused(), (torch.zeros(4, 8),), target="reference")
    assert [n.op for n in prog.graph.nodes if prog.graph.is_forward(n)].count(Op.MUL) == 0
    assert "aux.weight" not in prog.state and "fc.weight" in prog.state


class _Probe(nn.Module):
    def __init__(self, body: object) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.fc(x)))  # type: ignore[operator]


def _refusal(body: object) -> str:
    with pytest.raises(UnsupportedOpError) as err:
        mexc.compile(_Probe(body), (torch.zeros(4, 8),), target="reference")
    return str(err.value)


def _ms(h: torch.Tensor) -> torch.Tensor:
    return h.pow(2).mean(-1, keepdim=True)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (lambda h: h * torch.sqrt(torch.relu(h)), "square root of an activation"),
        (lambda h: torch.relu(h) * torch.rsqrt(_ms(h) + 1e-6), "root mean square of another"),
        (lambda h: h + torch.rsqrt(_ms(h) + 1e-6), "`add`"),
        (lambda h: h * torch.sqrt(_ms(h) + 1e-6), "multiplies by a root mean square"),
        (lambda h: h / h.std(-1).unsqueeze(-1), "without keepdim=True"),
        (lambda h: h / (torch.sqrt(_ms(h)) + 0.1), "adds 0.1 to a root mean square"),
        (lambda h: h / h.var(-1, keepdim=True), "not rooted"),
    ],
)
def test_other_uses_of_a_root_are_refused_by_node(body: object, says: str) -> None:
    message = _refusal(body)
    assert says in message and "test_written_out_norms.py" in message, message


def _changed_after_its_mean_square(h: torch.Tensor) -> torch.Tensor:
    r = torch.rsqrt(_ms(h) + 1e-6)
    h.mul_(2.0)
    return h * r


def _mean_square_changed(h: torch.Tensor) -> torch.Tensor:
    ms = _ms(h)
    ms.mul_(4.0)
    return h * torch.rsqrt(ms + 1e-6)


def _mean_changed(h: torch.Tensor) -> torch.Tensor:
    u = h.mean(-1, keepdim=True)
    u.add_(1.0)
    return (h - u) / torch.sqrt((h - u).pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize(
    "body", [_changed_after_its_mean_square, _mean_square_changed, _mean_changed]
)
def test_a_step_changed_in_place_in_between_is_refused(body: object) -> None:
    assert "changed in place in between" in _refusal(body)


def test_a_tensor_changed_in_place_before_its_normalization_is_normalized() -> None:
    def body(h: torch.Tensor) -> torch.Tensor:
        h.add_(1.0)
        return h * torch.rsqrt(_ms(h) + 1e-6)

    torch.manual_seed(0)
    model = _Probe(body)
    prog = mexc.compile(model, (torch.zeros(16, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch((16, 8))[0], rel=0.03)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (lambda h: h * torch.rsqrt(_ms(h).clamp(min=4.0)), "floors a mean of squares"),
        (lambda h: h * torch.rsqrt(h.pow(2).mean([], keepdim=True)), "batch axis"),
    ],
)
def test_a_large_floor_and_a_mean_over_every_axis_are_refused(body: object, says: str) -> None:
    assert says in _refusal(body)


def test_rms_norm_of_the_same_values_matches_torch_closely() -> None:
    torch.manual_seed(0)
    norm = _Probe(T5Norm(8))
    prog = mexc.compile(norm, (torch.zeros(16, 8),), rounding="nearest")
    x = small_batch((16, 8))[0]
    assert_logits_match_torch(norm, prog, x, rel=0.03)
    assert np.isfinite(prog.logits(x)).all()


def _ss(h: torch.Tensor) -> torch.Tensor:
    return h.pow(2).sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "body",
    [
        lambda h: h / _ss(h).sqrt(),
        lambda h: h * torch.rsqrt(_ss(h) + 1e-8),
        lambda h: h / (torch.sqrt(_ss(h)) + 1e-6),
        lambda h: h * _ss(h).clamp(min=1e-12).rsqrt(),
        lambda h: (
            (h - h.mean(-1, keepdim=True))
            / ((h - h.mean(-1, keepdim=True)).pow(2).sum(-1, keepdim=True) + 1e-5).sqrt()
        ),
    ],
)
def test_a_root_of_a_sum_of_squares_normalizes_as_torch(body: object) -> None:
    """x / sqrt(sum(x^2)): the layer norm of the mean square, over sqrt(D) (8 here); its eps
    on the sum, its root or as a floor, relative to the mean."""
    torch.manual_seed(0)
    model = _Probe(body)
    x, y = small_batch((16, 8))
    prog = mexc.compile(model, (torch.zeros(16, 8),), rounding="nearest")
    assert [n.op for n in prog.graph.nodes if prog.graph.is_forward(n)].count(Op.LAYERNORM) == 1
    want = model.eval()(torch.from_numpy(x)).detach().numpy()
    got = prog.logits(x)
    assert cosine(got, want) >= 0.999 and np.abs(got - want).max() <= 0.03 * np.abs(want).max()
    g, w = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(g["fc.weight"], w["fc.weight"]) >= 0.97


def test_a_division_by_a_one_element_constant_is_a_scale() -> None:
    """torch.sqrt(torch.tensor(d_k)), folded by the trace into a constant, divides as a
    number; a trained scalar parameter is still refused."""
    torch.manual_seed(0)
    body = _Probe(lambda h: h / torch.sqrt(torch.tensor(16.0)))
    prog = mexc.compile(body, (torch.zeros(4, 8),), target="reference")
    scales = [n for n in prog.graph.nodes if n.op is Op.SCALE and prog.graph.is_forward(n)]
    assert [float(n.attrs.value) for n in scales] == [0.25]

    class Temperature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Parameter(torch.tensor(2.0))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h / self.t

    assert "parameter or a constant tensor as an operand" in _refusal(Temperature())
