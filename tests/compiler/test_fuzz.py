"""Random small models from the supported op set compile, verify and train without overflow."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mexc
from mexc.numerics import VELOCITY_BITS, overflow_debug, qmax


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


@st.composite
def models(draw: st.DrawFn) -> nn.Module:
    channels = 1
    size = 8
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["conv", "dw", "res", "pool", "avg"]))
        if kind == "conv":
            out = draw(st.sampled_from([4, 8]))
            stride = draw(st.sampled_from([1, 2])) if size >= 4 else 1
            layers += [
                nn.Conv2d(channels, out, 3, stride, 1, bias=draw(st.booleans())),
                nn.BatchNorm2d(out),
                draw(st.sampled_from([nn.ReLU(), nn.ReLU6()])),
            ]
            channels, size = out, (size + 2 - 3) // stride + 1
        elif kind == "dw" and channels > 1:
            layers += [
                nn.Conv2d(channels, channels, 3, 1, 1, groups=channels, bias=False),
                nn.BatchNorm2d(channels),
                nn.ReLU6(),
            ]
        elif kind == "res" and channels > 1:
            layers.append(
                Residual(
                    nn.Sequential(
                        nn.Conv2d(channels, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels)
                    )
                )
            )
        elif kind in ("pool", "avg") and size >= 4:
            layers.append(nn.MaxPool2d(2) if kind == "pool" else nn.AvgPool2d(2))
            size //= 2
    head = draw(st.sampled_from(["flatten", "gap"]))
    if head == "gap":
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    else:
        hidden = draw(st.sampled_from([0, 16]))
        layers.append(nn.Flatten())
        if hidden:
            layers += [
                nn.Linear(channels * size * size, hidden),
                nn.BatchNorm1d(hidden),
                nn.ReLU(),
                nn.Dropout(0.25),
            ]
            layers.append(nn.Linear(hidden, 10))
        else:
            layers.append(nn.Linear(channels * size * size, 10))
    return nn.Sequential(*layers)


@settings(max_examples=15, deadline=None)
@given(model=models(), seed=st.integers(0, 2**16), bits=st.sampled_from([4, 6, 8]))
def test_random_models_train_two_steps_without_overflow(
    model: nn.Module, seed: int, bits: int
) -> None:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    prog = mexc.compile(model, (x,), seed=seed, bits=bits)
    with overflow_debug():
        losses = [prog.step(x, y) for _ in range(2)]
    assert all(np.isfinite(losses))
    for name, v in prog.state.items():
        # the velocity keeps VELOCITY_BITS at every B (docs/numerics.md section 12)
        q = qmax(VELOCITY_BITS if name.endswith(".velocity") else bits)
        assert np.abs(v.m.astype(np.int64)).max() <= q, name
    assert prog.predict(x).shape == (8,)
