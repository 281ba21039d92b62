"""The frontend propagates shapes on the meta device (no float forward at the full batch), and
falls back to the real propagation where that fails, which reports the model's own error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mexc.frontend as fe
from examples.models import EXAMPLES
from mexc.errors import InputError


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
