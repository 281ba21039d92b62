"""The C backend on the residual, depthwise and transformer examples: generated C training
programs (host target="c", ctypes) are bit-exact with the reference executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.data import load_fashion_mnist
from tests.compiler.helpers import EXAMPLES

from examples.vit import ViTTiny  # noqa: E402  (tests.compiler.helpers puts the root on sys.path)


def _module(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    if name == "ViTTiny":
        return ViTTiny(depth=1), (1, 28, 28)
    cls, shape = EXAMPLES[name]
    return cls(), shape


def _model(name: str, batch: int, target: str = "reference") -> mexc.Program:
    module, shape = _module(name)
    opt = mexc.SGD(
        lr=0.05,
        momentum=0.9,
        weight_decay=5e-4,
        schedule=mexc.Cosine(total_steps=40, warmup_steps=2),
    )
    return mexc.compile(module, (torch.zeros(batch, *shape),), optimizer=opt, target=target)


@pytest.mark.parametrize("name", ["SmallResNet", "MobileNetV2Tiny", "ViTTiny"])
def test_host_c_target_is_bit_exact_with_reference(name: str) -> None:
    batch = 4
    x, y = load_fashion_mnist("train")
    x, y = x[: 3 * batch], y[: 3 * batch]
    ref, c = _model(name, batch), _model(name, batch, target="c")
    assert c.state_checksum() == ref.state_checksum()
    for _ in range(2):  # 6 steps, both through the same replay order
        ref.replay((x, y), 3)
        c.replay((x, y), 3)
        assert c.state_checksum() == ref.state_checksum()
    assert np.array_equal(c.predict(x), ref.predict(x))
