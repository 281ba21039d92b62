"""torchvision and timm models, built unchanged (num_classes 10, 3 x 32 x 32 input), compiled
and trained 3 steps on a fixed batch: the integer loss falls, and llvm is bit-exact with the
reference after every step.

Each op family of these models has a small model trained bit-exact on every backend in
tests/compiler/test_zoo_ops.py. Here CI trains the models that represent a family and compile
quickly (`FAMILIES`); the others are marked slow and run with MEXC_ZOO=all (the llvm build of a
model's kernels takes 30-110 s on a cold kernel cache, 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import mexc

tv = pytest.importorskip("torchvision.models")
timm = pytest.importorskip("timm")


def _tv_vit() -> nn.Module:
    return tv.VisionTransformer(
        image_size=32, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
        num_classes=10,
    )  # fmt: skip


def _timm_vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: tv.resnet18(num_classes=10),
    "resnet50": lambda: tv.resnet50(num_classes=10),
    "mobilenet_v2": lambda: tv.mobilenet_v2(num_classes=10),
    "mobilenet_v3_small": lambda: tv.mobilenet_v3_small(num_classes=10),
    "shufflenet_v2_x0_5": lambda: tv.shufflenet_v2_x0_5(num_classes=10),
    "squeezenet1_1": lambda: tv.squeezenet1_1(num_classes=10),
    "densenet121": lambda: tv.densenet121(num_classes=10),
    "efficientnet_b0": lambda: tv.efficientnet_b0(num_classes=10),
    "convnext_tiny": lambda: tv.convnext_tiny(num_classes=10),
    "torchvision_vit": _tv_vit,
    "timm_vit_tiny": _timm_vit,
    "timm_resnet18": lambda: timm.create_model("resnet18", num_classes=10),
}
# the CI set, one model per op family: concat + chunk + channel shuffle, ceil_mode pooling and
# concat, squeeze-and-excitation with Hardsigmoid and Hardswish, MultiheadAttention with a
# class token, timm's fused attention (unbind, scaled_dot_product_attention)
FAMILIES = {
    "shufflenet_v2_x0_5",
    "squeezenet1_1",
    "mobilenet_v3_small",
    "torchvision_vit",
    "timm_vit_tiny",
}
FULL = os.environ.get("MEXC_ZOO") == "all"
BATCH, STEPS, LR = 8, 3, 0.01


def _cases() -> list:
    return [
        pytest.param(name, marks=() if name in FAMILIES or FULL else pytest.mark.skip(
            reason="slow to build: MEXC_ZOO=all runs it"))
        for name in MODELS
    ]  # fmt: skip


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)
    return x, rng.integers(0, 10, BATCH)


def _train(name: str, target: str) -> tuple[list[float], list[str], mexc.Program]:
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = _batch()
    opt = mexc.SGD(lr=LR, momentum=0.9, weight_decay=5e-4)
    prog = mexc.compile(model, (torch.from_numpy(x),), optimizer=opt, target=target)
    losses, sums = [], []
    for _ in range(STEPS):
        losses.append(prog.step(x, y))
        sums.append(prog.state_checksum())
    return losses, sums, prog


@pytest.mark.slow
@pytest.mark.parametrize("name", _cases())
def test_model_trains_on_reference_and_llvm_bit_exact(name: str) -> None:
    losses, want, _ = _train(name, "reference")
    assert losses[-1] < losses[0], losses  # the integer loss falls on the fixed batch
    got_losses, got, prog = _train(name, "llvm")
    assert type(prog).__name__ == "LlvmProgram"  # every op lowered: no fallback
    assert got == want
    assert got_losses == losses
