"""GroupNorm (docs/layers.md): LayerNorm's recipe over rows (sample, group) with the affine per
channel. Against torch's F.group_norm in both directions, as a module and as the function timm
calls, and a model with it trained bit-exact on every backend: reference, llvm, C, and the
CUDA artifact's own source on the CPU emulator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc import kernels as K
from mexc.ir import Op
from mexc.kernels.transformer import affine_channels
from mexc.mx import MX, RoundCtx
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    train_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _float(v: MX) -> torch.Tensor:
    return torch.from_numpy(np.asarray(v.m).astype(np.float64) * 2.0 ** float(v.e))


def test_affine_channels() -> None:
    """LayerNorm: the column; GroupNorm with 2 groups of 2 channels of 3 elements: the channel."""
    np.testing.assert_array_equal(affine_channels(2, 3), [[0, 1, 2], [0, 1, 2]])
    want = [[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3], [0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]]
    np.testing.assert_array_equal(affine_channels(4, 6, groups=2, per=3), want)


@pytest.mark.parametrize(
    ("shape", "groups"),
    [((4, 6, 5, 5), 2), ((4, 6, 5, 5), 1), ((4, 6, 5, 5), 6), ((3, 8, 4, 2), 4), ((6, 12), 3)],
)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_groupnorm_matches_torch(shape: tuple[int, ...], groups: int, rounding: str) -> None:
    """Some groups, one group (PoolFormer's GroupNorm1), a group per channel (instance norm)
    and (N, C): the output, dx, dgamma and dbeta (exact: a sum) against torch's autograd."""
    c = shape[1]
    per = int(np.prod(shape[2:]))
    rng = np.random.default_rng(sum(shape) + groups)
    ctx = RoundCtx(rounding, 3, 1)  # type: ignore[arg-type]
    offsets = rng.integers(-30, 30, (1, c) + (1,) * (len(shape) - 2))
    x = MX.of(np.clip(rng.integers(-90, 91, shape) // 2 + offsets, -127, 127), -4)
    g, b = MX.of(rng.integers(40, 128, c), -7), MX.of(rng.integers(-127, 128, c), -8)
    y, saved = K.layernorm_forward(x, g, b, 1e-5, ctx, 0, groups, per)
    xt, gt, bt = (_float(v).requires_grad_() for v in (x, g, b))
    yt = F.group_norm(xt, groups, gt, bt, eps=1e-5)
    assert _cos(_float(y).numpy(), yt.detach().numpy()) >= 0.99
    dy = MX.of(rng.integers(-127, 128, shape), -9)
    yt.backward(_float(dy))
    dx, dg, db = K.layernorm_backward(dy, saved, ctx, 16)
    assert dg.a.shape == (c,) and db.a.shape == (c,)
    assert xt.grad is not None and gt.grad is not None and bt.grad is not None
    assert _cos(_float(dx).numpy(), xt.grad.numpy()) >= 0.98
    assert _cos(dg.a * 2.0 ** float(dg.e), gt.grad.numpy()) >= 0.99
    np.testing.assert_allclose(db.a * 2.0 ** float(db.e), bt.grad.numpy())


def test_one_group_per_row_is_layernorm() -> None:
    """GroupNorm of (N, C) with one group normalizes each row, as LayerNorm over C does."""
    rng = np.random.default_rng(5)
    ctx = RoundCtx("stochastic", 2, 0)
    x = MX.of(rng.integers(-127, 128, (4, 16)), -5)
    g, b = MX.of(rng.integers(-127, 128, 16), -7), MX.of(rng.integers(-127, 128, 16), -8)
    gn, _ = K.layernorm_forward(x, g, b, 1e-5, ctx, 0, 1, 1)
    ln, _ = K.layernorm_forward(x, g, b, 1e-5, ctx, 0)
    np.testing.assert_array_equal(gn.m, ln.m)


class FunctionalGroupNorm(nn.GroupNorm):
    """timm's GroupNorm: a subclass whose forward calls F.group_norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class GroupNormNet(nn.Module):
    """GroupNorm as a module (2 groups) and through F.group_norm (one group), then a head
    with GroupNorm over (N, C) (4 groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.gn2 = FunctionalGroupNorm(1, 8)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.gn3 = nn.GroupNorm(4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.gn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.gn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.gn3(self.fc1(torch.flatten(x, 1)))))


def _program(target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(
        GroupNormNet(), (torch.zeros(4, 1, 8, 8),), optimizer=opt, target=target, bits=bits
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    ref = _program("reference", bits)
    norms = [n for n in ref.graph.nodes if n.op is Op.LAYERNORM]
    assert sorted(int(n.attrs.groups) for n in norms) == [1, 2, 4]
    want = train_checksums(ref)
    assert len(set(want)) == 3
    assert train_checksums(_program("llvm", bits)) == want
    assert train_checksums(_program("c", bits)) == want


def test_instance_norm_is_groupnorm_with_a_group_per_channel() -> None:
    """InstanceNorm2d(affine=True) compiles to the same program as GroupNorm(C, C) with the
    same parameters; without affine or with running statistics it is refused."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((4, 3, 6, 6)).astype(np.float32), np.array([0, 1, 2, 0])
    runs = []
    for norm in (nn.InstanceNorm2d(3, affine=True), nn.GroupNorm(3, 3)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 3, 3), norm, nn.Flatten(), nn.Linear(48, 3))
        prog = mexc.compile(model, (torch.from_numpy(x),), target="reference")
        runs.append([(prog.step(x, y), prog.state_checksum()) for _ in range(2)])
    assert runs[0] == runs[1]
    bad = nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
    model = nn.Sequential(bad, nn.Flatten(), nn.Linear(12, 3))
    with pytest.raises(mexc.UnsupportedOpError, match="track_running_stats=False"):
        mexc.compile(model, (torch.zeros(2, 3, 2, 2),))


class WithoutAffine(nn.Module):
    """Norms without their affine weight or bias: GroupNorm(affine=False),
    InstanceNorm2d (affine=False, torch's default), LayerNorm(bias=False),
    LayerNorm(elementwise_affine=False) and F.layer_norm with neither (MetaFormer's
    LayerNorm2d without bias reads F.layer_norm(x, shape, weight, None))."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4, affine=False)
        self.inorm = nn.InstanceNorm2d(4)
        self.ln_nobias = nn.LayerNorm(4, bias=False)
        self.ln_plain = nn.LayerNorm(4, elementwise_affine=False)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inorm(self.gn(self.conv(x))).permute(0, 2, 3, 1)
        y = F.layer_norm(self.ln_plain(self.ln_nobias(y)), (4,))
        return self.fc(torch.flatten(y, 1))


def test_norms_without_affine_hold_constant_ones_and_zeros() -> None:
    """The missing weights and biases are constants (1 and 0) that no step changes; the
    model trains bit-exact on llvm and C, and its logits are torch's."""
    torch.manual_seed(0)
    model = WithoutAffine()
    progs = {
        t: mexc.compile(model, (torch.zeros(4, 1, 6, 6),), target=t, rounding="nearest")
        for t in ("reference", "llvm", "c")
    }
    ref = progs["reference"]
    constants = [
        *(
            f"mexc.{m}.{w}"
            for m in ("gn", "inorm", "ln_plain", "layer_norm")
            for w in ("weight", "bias")
        ),
        "mexc.ln_nobias.bias",
    ]
    assert all(k in ref.state for k in constants)
    before = {k: ref.state[k].dequantize().copy() for k in constants}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 6, 6)).astype(np.float32)
    assert_logits_match_torch(model, ref, x)
    labels = rng.integers(0, 10, 4)
    sums = {t: train_checksums(p, (x, labels)) for t, p in progs.items()}
    assert sums["llvm"] == sums["reference"] == sums["c"]
    for k in constants:
        np.testing.assert_array_equal(ref.state[k].dequantize(), before[k])
        assert set(np.unique(before[k])) <= {0.0, 1.0}, k
    # trained: it has a velocity (3 steps at nearest rounding need not move the weight itself)
    assert ref.state["ln_nobias.weight.velocity"].m.any()


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program("reference"), tmp_path)


def test_a_batch_norm_without_affine_holds_constant_ones_and_zeros() -> None:
    """BatchNorm2d(affine=False): its weight and bias are constants 1 and 0, its running
    statistics are torch's after training (the logits in evaluation match)."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.bn = nn.BatchNorm2d(4, affine=False)
            self.fc = nn.Linear(4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))

    torch.manual_seed(0)
    model = Plain()
    prog = mexc.compile(model, (torch.zeros(8, 1, 6, 6),), rounding="nearest")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1, 6, 6)).astype(np.float32)
    for _ in range(3):
        prog.step(x, rng.integers(0, 10, 8))
    assert prog.state["mexc.bn.weight"].dequantize().tolist() == [1.0] * 4
    assert prog.state["mexc.bn.bias"].dequantize().tolist() == [0.0] * 4
    assert prog.state["bn.running_mean"].dequantize().any()  # updated
    assert_logits_match_torch(model, prog, x)


class OverSeveralAxes(nn.Module):
    """nn.LayerNorm([C, H, W]) (or F.layer_norm of the same shape and parameters): one
    `layernorm` over the flattened axes, its weight and bias held flattened."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.functional = functional
        self.conv = nn.Conv2d(1, 4, 3)
        self.ln = nn.LayerNorm([4, 6, 6])
        self.fc = nn.Linear(4, 10)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.functional:
            h = F.layer_norm(h, h.shape[1:], self.ln.weight, self.ln.bias)
        else:
            h = self.ln(h)
        return self.fc(F.relu(h).mean((2, 3)))


def test_a_layer_norm_over_several_axes_matches_torch_and_goes_back() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)
    sums = []
    for functional in (False, True):
        torch.manual_seed(0)
        model = OverSeveralAxes(functional)
        prog = mexc.compile(model, (torch.zeros(8, 1, 8, 8),), rounding="nearest")
        assert [n.op for n in prog.graph.nodes].count(Op.LAYERNORM) == 1
        assert_logits_match_torch(model, prog, x)
        assert_gradients_follow_autograd(
            model, prog, x, y, ("ln.weight", "ln.bias", "conv.weight"), 0.96
        )
        sums.append(train_checksums(prog, (x, y)))
        back = prog.to_module(OverSeveralAxes(functional))
        held = prog.float_weights()["ln.weight"]
        assert held.shape == (4, 6, 6) and np.array_equal(back.ln.weight.detach().numpy(), held)
    assert sums[0] == sums[1]
