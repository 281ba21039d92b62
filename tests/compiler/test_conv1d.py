"""1-D layers (time series, audio, sensor data): Conv1d, BatchNorm1d over (N, C, L), MaxPool1d,
AvgPool1d and the adaptive 1-D pools run as the 2-D ops over (N, C, 1, L) (docs/frontend.md).
A 1-D model trains with exactly the bits of the same model written with (1, k) 2-D layers, and
bit-exact on every backend: reference, llvm, C, and the CUDA artifact's own source on the CPU
emulator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from mexc.ir import Op
from tests.compiler.helpers import assert_cuda_source_trains_bit_exact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402


class Net1d(nn.Module):
    """Conv1d (stride, padding, bias; grouped), BatchNorm1d, MaxPool1d with ceil_mode,
    AvgPool1d, F.conv1d with a module's weight, AdaptiveMaxPool1d and AdaptiveAvgPool1d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(3, 8, 5, stride=2, padding=2)
        self.bn = nn.BatchNorm1d(8)
        self.conv2 = nn.Conv1d(8, 8, 3, padding=1, groups=2, bias=False)
        self.conv3 = nn.Conv1d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool1d(F.relu(self.bn(self.conv1(x))), 3, 2, ceil_mode=True)  # 16 -> 8
        x = nn.functional.avg_pool1d(F.relu(self.conv2(x)), 2)  # 4
        x = F.relu(F.conv1d(x, self.conv3.weight, self.conv3.bias, padding=1))
        x = torch.cat([F.adaptive_max_pool1d(x, 2), F.adaptive_avg_pool1d(x, 1)], dim=2)
        return self.fc(torch.flatten(x, 1))


def test_1d_upsampling_is_2d_upsampling_over_one_row() -> None:
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.Upsample(scale_factor=3), nn.Flatten())
    model = nn.Sequential(model, nn.Linear(24, 3))
    g = mexc.compile(model, (torch.zeros(2, 2, 4),), target="reference").graph
    up = [n for n in g.nodes if n.op.value == "upsample_nearest"]
    assert len(up) == 1 and tuple(up[0].attrs.scale) == (1, 3)


class Net2d(nn.Module):
    """Net1d written with 2-D layers over (N, C, 1, L): (1, k) kernels holding Net1d's weights
    (as (O, C, 1, k)), BatchNorm2d, (1, k) pools; the same parameter names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        one = Net1d()
        self.conv1 = nn.Conv2d(3, 8, (1, 5), stride=(1, 2), padding=(0, 2))
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, (1, 3), padding=(0, 1), groups=2, bias=False)
        self.conv3 = nn.Conv2d(8, 8, (1, 3), padding=(0, 1))
        self.fc = one.fc
        with torch.no_grad():
            for name in ("conv1", "conv2", "conv3"):
                conv, src = getattr(self, name), getattr(one, name)
                conv.weight.copy_(src.weight.unsqueeze(2))
                if src.bias is not None:
                    conv.bias.copy_(src.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), (1, 3), (1, 2), ceil_mode=True)
        x = F.avg_pool2d(F.relu(self.conv2(x)), (1, 2))
        x = F.relu(self.conv3(x))
        x = torch.cat([F.max_pool2d(x, (1, 2)), F.adaptive_avg_pool2d(x, 1)], dim=3)
        return self.fc(torch.flatten(x, 1))


def _batch(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32)).astype(np.float32) * 2
    return x.reshape(shape), rng.integers(0, 10, 4)


def _program(cls: type[nn.Module], target: str, bits: int = 8) -> mexc.Program:
    torch.manual_seed(0)
    shape = (4, 3, 32) if cls is Net1d else (4, 3, 1, 32)
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    return mexc.compile(cls(), (torch.zeros(shape),), optimizer=opt, target=target, bits=bits)


def _train(prog: mexc.Program, shape: tuple[int, ...], steps: int = 3) -> list[tuple]:
    x, y = _batch(shape)
    return [(prog.step(x, y), prog.state_checksum()) for _ in range(steps)]


def test_1d_layers_train_with_the_bits_of_their_2d_form() -> None:
    """The same losses and state after every step (weights held as (O, C, 1, k))."""
    got = _train(_program(Net1d, "reference"), (4, 3, 32))
    want = _train(_program(Net2d, "reference"), (4, 3, 1, 32))
    assert got == want
    assert len({s for _, s in got}) == 3
    assert _program(Net1d, "reference").state["conv1.weight"].m.shape == (8, 3, 1, 5)


@pytest.mark.parametrize("bits", [8, 4])
def test_model_trains_bit_exact_on_reference_llvm_and_c(bits: int) -> None:
    want = _train(_program(Net1d, "reference", bits), (4, 3, 32))
    for target in ("llvm", "c"):
        got = _train(_program(Net1d, target, bits), (4, 3, 32))
        assert [s for _, s in got] == [s for _, s in want], target


def test_string_padding_is_torchs_and_an_unbatched_input_is_refused() -> None:
    """padding="same" (here 1 each side) and "valid" (none) as torch pads."""
    for padding, length in (("same", 8), ("valid", 6)):
        conv = nn.Conv1d(3, 4, 3, padding=padding)
        prog = mexc.compile(
            nn.Sequential(conv, nn.Flatten(), nn.Linear(4 * length, 3)), (torch.zeros(2, 3, 8),)
        )
        (node,) = prog.graph.nodes_of(Op.CONV2D_COMPACT)
        assert tuple(node.attrs.padding) == (0, 1 if padding == "same" else 0)
    with pytest.raises(mexc.UnsupportedOpError, match="unbatched input"):
        mexc.compile(nn.Conv1d(3, 4, 3), (torch.zeros(3, 8),))


@needs_cuda_tools
@pytest.mark.slow
def test_model_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    assert_cuda_source_trains_bit_exact(_program(Net1d, "reference"), tmp_path)
