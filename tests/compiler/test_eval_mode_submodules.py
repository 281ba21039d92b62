"""Submodules a training model keeps in eval mode (mexc.frontend_eval_modes): a frozen batch norm
normalizes with its running statistics, which stay as they are, and a dropout in eval mode drops
nothing, as in torch. Before, mexc trained them as training-mode layers without a word."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import (
    _as_input,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    integer_gradients,
    step_values,
)


class FrozenNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.bn1 = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 10)
        with torch.no_grad():  # statistics far from a batch's, so batch statistics would show
            for b in (self.bn, self.bn1):
                b.running_mean.uniform_(-0.5, 0.5)
                b.running_var.uniform_(0.5, 2.0)
                b.weight.uniform_(0.5, 1.5)
                b.bias.uniform_(-0.3, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc(self.drop(self.bn1(h)))


def _frozen() -> nn.Module:
    torch.manual_seed(0)
    model = FrozenNorms().train()
    for m in (model.bn, model.bn1, model.drop):
        m.eval()  # fine-tuning with frozen batch norms
    return model


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8)


def _ops(prog: mexc.Program) -> set[Op]:
    return {n.op for n in prog.graph.nodes}


def test_a_frozen_batch_norm_trains_as_torch_trains_it() -> None:
    model, (x, y) = _frozen(), _batch()
    prog = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),))
    assert not {Op.BATCHNORM, Op.DROPOUT} & _ops(prog)
    assert not any("running" in name for name in prog.state if not name.startswith("mexc."))
    # the step's logits and gradients against torch's, the frozen norms in eval mode
    logits = step_values(prog, x, y)[prog.graph.output("logits")].dequantize()
    ref = prog.to_module(copy.deepcopy(model).double())
    assert ref.training and not ref.bn.training  # to_module keeps the modes
    out = ref(_as_input(prog, x))
    assert cosine(logits, out.detach().numpy()) > 0.999
    F.cross_entropy(out, torch.from_numpy(y)).backward()
    grads = dict(ref.named_parameters())
    for name, g in integer_gradients(prog, x, y).items():
        assert grads[name].grad is not None
        assert cosine(g, grads[name].grad.numpy()) > 0.99, name
    # trained: the statistics stay, the affine parameters move
    for _ in range(2):
        prog.step(x, y)
    trained = prog.to_module(copy.deepcopy(model))
    assert torch.equal(trained.bn.running_mean, model.bn.running_mean)
    assert torch.equal(trained.bn1.running_var, model.bn1.running_var)
    assert not torch.equal(trained.bn.weight, model.bn.weight)


def test_a_frozen_batch_norm_is_bit_exact_on_llvm_and_c() -> None:
    x, y = _batch()

    def program(target: str) -> mexc.Program:
        return mexc.compile(_frozen(), (torch.from_numpy(x),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program("reference"), program, (x[:8], y[:8]))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(h), 0.5, self.training)


class FunctionalForms(nn.Module):
    """timm's BatchNormAct2d (F.batch_norm on its buffers) and F.dropout(training=self.training)
    in a block of the model's own."""

    def __init__(self) -> None:
        super().__init__()
        timm_layers = pytest.importorskip("timm.layers")
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = timm_layers.BatchNormAct2d(8, act_layer=nn.ReLU)
        self.block = Block()
        self.head = nn.Linear(8, 10)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.bn(self.conv(x)).mean((2, 3))))


def test_functional_batch_norm_and_dropout_in_eval_mode() -> None:
    torch.manual_seed(0)
    model, (x, y) = FunctionalForms().train(), _batch()
    model.bn.eval()
    model.block.eval()
    prog = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),))
    assert not {Op.BATCHNORM, Op.DROPOUT} & _ops(prog)
    logits = step_values(prog, x, y)[prog.graph.output("logits")].dequantize()
    ref = prog.to_module(copy.deepcopy(model).double())
    assert cosine(logits, ref(_as_input(prog, x)).detach().numpy()) > 0.999
    # the same model training throughout, and a model compiled in eval mode as a whole, keep
    # the training program's batch norm (and dropout where the block trains)
    model.block.train()
    assert Op.DROPOUT in _ops(mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),)))
    assert Op.BATCHNORM in _ops(mexc.compile(model.eval(), (torch.from_numpy(x),)))


class Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.3, batch_first=True)
        self.rnn = nn.GRU(16, 16, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.rnn(h)[0].mean(1))


def test_attention_and_recurrent_dropout_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = Attending().train()
    x = torch.randn(4, 6, 16)
    assert Op.DROPOUT in _ops(mexc.compile(copy.deepcopy(model), (x,)))
    model.attn.eval()
    model.rnn.eval()
    assert Op.DROPOUT not in _ops(mexc.compile(model, (x,)))


def test_compile_leaves_each_submodule_in_its_mode() -> None:
    model, (x, _) = _frozen(), _batch()
    mexc.compile(model, (torch.from_numpy(x),))
    assert model.training and model.conv.training
    assert not (model.bn.training or model.bn1.training or model.drop.training)


class TrainTimeTemperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x)
        if self.training:  # traced in eval mode: this branch is not in the training step
            logits = logits / 4.0
        return logits


def test_a_branch_on_self_training_is_named_in_a_warning() -> None:
    x = torch.zeros(4, 16)
    # in eval mode as a whole it is compiled to be trained: the branch is lost there too
    for model in (TrainTimeTemperature(), TrainTimeTemperature().eval()):
        with pytest.warns(UserWarning, match=r"eval-mode path.*TrainTimeTemperature \(test_eval"):
            mexc.compile(model, (x,))
    with warnings.catch_warnings():  # library classes: no warning
        warnings.simplefilter("error")
        mexc.compile(_frozen(), (torch.from_numpy(_batch()[0]),))


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = TrainTimeTemperature()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_branch_in_a_submodule_kept_in_eval_mode_is_torch_s_path() -> None:
    model = Wrapped().train()
    model.inner.eval()  # torch takes the eval path there too: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mexc.compile(model, (torch.zeros(4, 16),))


class Stage(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.relu(self.bn(self.conv(x))))


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stages = nn.Sequential(Stage(8), Stage(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def test_each_module_follows_its_own_flag() -> None:
    x = torch.from_numpy(_batch()[0])
    model = Backbone().train()
    model.stages.eval()
    model.stages[1].train()  # fine-tune the last stage of a frozen backbone
    prog = mexc.compile(copy.deepcopy(model), (x,))
    ops = [n.op for n in prog.graph.nodes]
    assert ops.count(Op.BATCHNORM) == 1 and ops.count(Op.DROPOUT) == 1
    assert "stages.1.bn.running_mean" in prog.state and "stages.0.bn.running_mean" not in prog.state
    # linear probing: the model in eval mode but its head; the frozen stages stay frozen
    model.eval()
    model.head.train()
    assert not {Op.BATCHNORM, Op.DROPOUT} & _ops(mexc.compile(model, (x,)))


class ByKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(input=self.conv(x)).mean((2, 3)))


def test_a_frozen_norm_called_by_keyword() -> None:
    model = ByKeyword().train()
    model.bn.eval()
    assert Op.BATCHNORM not in _ops(mexc.compile(model, (torch.from_numpy(_batch()[0]),)))


def test_bias_norm_trains_a_frozen_norm_s_weight() -> None:
    prog = mexc.compile(_frozen(), (torch.from_numpy(_batch()[0]),), trainable="bias-norm")
    trained = {str(n.attrs.param) for n in prog.graph.nodes_of(Op.SGD_UPDATE)}
    assert {"bn.weight", "bn.bias", "bn1.weight", "bn1.bias"} <= trained
    assert "conv.weight" not in trained


class SpreadStatistics(nn.Module):
    """Running variances over 4 decades across channels, as in pretrained networks."""

    def __init__(self, channels: int = 64) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, channels)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.bn.running_var.copy_(10 ** (torch.rand(channels, generator=g) * 4 - 2))
            self.bn.running_mean.copy_(
                torch.randn(channels, generator=g) * self.bn.running_var.sqrt()
            )
            self.fc.weight.copy_(torch.eye(channels))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x).mean((2, 3)))


def test_a_frozen_norm_over_statistics_spanning_decades() -> None:
    model = SpreadStatistics().train()
    model.bn.eval()
    std, mean = model.bn.running_var.sqrt().numpy(), model.bn.running_mean.numpy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64, 4, 4)) * std[:, None, None] + mean[:, None, None]
    x = x.astype(np.float32)
    prog = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),))
    logits = step_values(prog, x, np.arange(8))[prog.graph.output("logits")].dequantize()
    want = model(_as_input(prog, x).float()).detach().numpy()
    assert cosine(logits, want) > 0.995  # (x - mean) * inv, one part each: 0.96 at 3 decades


class FrozenByTrain(FrozenNorms):
    """Freezes its batch norms in train(), and prints itself: neither is traced."""

    def train(self, mode: bool = True) -> FrozenByTrain:
        super().train(mode)
        if self.training:
            self.bn.eval()
        return self

    def extra_repr(self) -> str:
        return "frozen" if not self.training else ""


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if not training:
        return x
    keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - p)
    return x * keep / (1 - p)


class OwnDropPath(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(s, x: torch.Tensor) -> torch.Tensor:  # noqa: N805 - the instance by any name
        return s.fc(x + drop_path(x, 0.5, s.training))


def test_the_warning_reads_what_forward_runs() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mexc.compile(FrozenByTrain().train(), (torch.from_numpy(_batch()[0]),))
    with pytest.warns(UserWarning, match=r"OwnDropPath \(test_eval_mode_submodules.py:\d+\)"):
        mexc.compile(OwnDropPath(), (torch.zeros(4, 16),))


def test_the_fp32_baseline_trains_with_the_same_modes() -> None:
    from mexc.fp32 import train_fp32

    model, (x, y) = _frozen(), _batch()
    mean = model.bn.running_mean.clone()
    opt = mexc.SGD(lr=0.01, momentum=0.9)
    train_fp32(model, (x, y), (x, y), opt, batch=4, seed=0, epochs=1)
    assert torch.equal(model.bn.running_mean, mean) and not model.bn.training


class LookAlikeNames(nn.Module):
    """Two frozen norms whose paths differ only by a dot and an underscore."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = nn.Module()
        self.blk.bn_1 = nn.BatchNorm1d(2)
        self.blk_bn = nn.Sequential(nn.Identity(), nn.BatchNorm1d(2))
        with torch.no_grad():
            self.blk.bn_1.running_var.fill_(9.0)
            self.blk_bn[1].running_var.fill_(0.01)
        self.fc = nn.Linear(2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blk_bn(self.blk.bn_1(x)))


def test_frozen_norms_with_look_alike_names_keep_their_own_constants() -> None:
    model = LookAlikeNames().train()
    model.blk.bn_1.eval()
    model.blk_bn.eval()
    prog = mexc.compile(model, (torch.zeros(4, 2),))
    inverse = sorted(
        float(v.dequantize().ravel()[0])
        for name, v in prog.state.items()
        if name.endswith("inverse_std")
    )
    assert inverse == pytest.approx([1 / 3, 10.0], rel=0.01)


class MadeFromABuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)
        self.register_buffer("scale", torch.full((10,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.tensor(0.5) * self.scale


def test_compile_adds_no_attribute_to_the_model() -> None:
    model = MadeFromABuffer()
    before = set(vars(model))
    for _ in range(2):  # fx kept each traced tensor constant on the model, more every compile
        mexc.compile(model, (torch.zeros(4, 16),))
    assert set(vars(model)) == before


def test_sync_batch_norm_is_the_whole_batch_s_batch_norm() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.SyncBatchNorm(8), nn.Flatten(), nn.LazyLinear(10))
    x = torch.from_numpy(_batch()[0])
    model(x)  # materialize the lazy layer
    assert Op.BATCHNORM in _ops(mexc.compile(model, (x,)))
    model[1].eval()  # frozen: its own forward is _BatchNorm's in eval mode
    assert Op.BATCHNORM not in _ops(mexc.compile(model, (x,)))
