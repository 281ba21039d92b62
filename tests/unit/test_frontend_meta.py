"""The frontend propagates shapes on the meta device (no float forward at the full batch), and
falls back to the real propagation where that fails, which reports the model's own error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
import mexc.frontend as fe
from examples.models import EXAMPLES
from mexc.errors import InputError, TraceError


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_shapes_come_from_the_meta_device(name: str) -> None:
    cls, shape = EXAMPLES[name]
    model = cls().eval()
    gm = torch.fx.GraphModule(model, fe._Tracer().trace(model))
    x = torch.randn(3, *shape)
    assert fe._propagate_on_meta(gm, x)
    real = torch.fx.GraphModule(model, fe._Tracer().trace(model))
    fe._ShapeProp(real).propagate(x)
    for a, b in zip(gm.graph.nodes, real.graph.nodes):
        ma, mb = a.meta.get("tensor_meta"), b.meta.get("tensor_meta")
        assert getattr(ma, "shape", None) == getattr(mb, "shape", None), a.name
        assert getattr(ma, "dtype", None) == getattr(mb, "dtype", None), a.name


def test_a_model_that_fails_on_its_input_is_reported_by_the_real_propagation() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 10))
    with pytest.raises(InputError, match="node"):
        fe.trace(model, torch.randn(2, 1, 8, 8))  # 1 channel where the conv wants 3


class ShapeBranches(nn.Module):
    """Python branches on shapes, which plain symbolic tracing cannot follow: on the input's
    channels, on a convolution's output width, and on a Linear's output (a leaf module whose
    meta result needs its parameters on the meta device) after F.batch_norm on buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Conv2d(1, 4, 3, padding=1)
        self.three = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 10)
        self.wide = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, channels, _, _ = x.shape
        y = self.one(x) if channels == 1 else self.three(x)
        y = F.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight,
                         self.bn.bias, self.training)  # fmt: skip
        if y.size(-1) != 4:
            y = F.max_pool2d(y, y.size(-1) // 4)
        z = self.fc(y.flatten(1))
        return self.wide(z) if z.shape[-1] == 10 else z


class Static(ShapeBranches):
    """The same model with the example's branches taken."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.three(x)
        y = F.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight,
                         self.bn.bias, self.training)  # fmt: skip
        return self.wide(self.fc(F.max_pool2d(y, 2).flatten(1)))


def test_branches_on_shapes_trace_with_the_example_shapes() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 4)
    runs = []
    for cls in (ShapeBranches, Static):
        torch.manual_seed(0)
        prog = mexc.compile(cls(), (torch.zeros(4, 3, 8, 8),), target="reference")
        runs.append([(prog.step(x, y), prog.state_checksum()) for _ in range(2)])
    assert runs[0] == runs[1]


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 4 and x.sum() > 0:  # the shape is known; the value is not
            x = x * 2
        return self.fc(x)


def test_a_branch_on_values_is_still_refused(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TraceError, match=r"data-dependent control flow at test_frontend_meta"):
        mexc.compile(ValueBranch(), (torch.zeros(2, 4),))
    assert capfd.readouterr().err == ""  # no warnings of the second try's meta tracing


class ShapeArithmetic(nn.Module):
    """Sizes computed from shapes as arguments: a window padding (DaViT), a slice's bounds
    (PiT's class tokens), and int(math.sqrt(tokens)) (NesT), which symbolic tracing alone
    cannot evaluate."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 3 * 9, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import math

        y = self.conv(x)
        w = y.shape[-1]
        y = F.pad(y, (0, (3 - w % 3) % 3))  # 7 -> 9
        side = int(math.sqrt(y.shape[2] * y.shape[2]))
        return self.fc(y[:, :, side - 3 : side].flatten(1))


class Written(ShapeArithmetic):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(self.conv(x), (0, 2))
        return self.fc(y[:, :, 4:7].flatten(1))


def test_sizes_computed_from_shapes_are_constants() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 7, 7)).astype(np.float32), rng.integers(0, 10, 4)
    runs = []
    for cls in (ShapeArithmetic, Written):
        torch.manual_seed(0)
        prog = mexc.compile(cls(), (torch.zeros(4, 3, 7, 7),), target="reference")
        runs.append([(prog.step(x, y), prog.state_checksum()) for _ in range(2)])
    assert runs[0] == runs[1]


class NeedsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * int(x.mean())  # a tensor's value as a Python int


def test_python_on_a_tensor_value_is_one_paragraph_naming_the_line() -> None:
    with pytest.raises(TraceError) as err:
        mexc.compile(NeedsAValue(), (torch.zeros(2, 4),))
    text = str(err.value)
    assert "could not be traced at test_frontend_meta.py:" in text
    assert "compute such numbers from shapes" in text and "\n" not in text
