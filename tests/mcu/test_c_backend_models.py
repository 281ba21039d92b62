"""The C backend on the residual, depthwise and transformer examples: generated C training
programs (host target="c", ctypes) are bit-exact with the reference executor."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from examples.vit import ViTTiny  # noqa: E402  (tests.compiler.helpers puts the root on sys.path)
from mexc.data import load_fashion_mnist
from mexc.ir import Op
from tests.compiler.helpers import EXAMPLES


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


@pytest.mark.parametrize("name,batch", [("SmallResNet", 2), ("MobileNetV2Tiny", 2), ("ViTTiny", 4)])
def test_host_c_target_is_bit_exact_with_reference(name: str, batch: int) -> None:
    x, y = load_fashion_mnist("train")
    x, y = x[: 3 * batch], y[: 3 * batch]
    ref, c = _model(name, batch), _model(name, batch, target="c")
    assert c.state_checksum() == ref.state_checksum()
    for _ in range(2):  # 6 steps, both through the same replay order
        ref.replay((x, y), 3)
        c.replay((x, y), 3)
        assert c.state_checksum() == ref.state_checksum()
    assert np.array_equal(c.predict(x), ref.predict(x))


class PoolDropNet(nn.Module):
    """Average pooling, dropout and channel slices: the remaining ops of the C backend."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(3, stride=2, padding=1)
        self.act = nn.ReLU6()
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(3 * 14 * 14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.conv(x)))  # (N, 8, 14, 14)
        a, b = x[:, 0:3], x[:, 4:7]  # two channel slices apart: each its slice_grad
        return self.fc(self.drop((a + b).flatten(1)))


def test_pool_dropout_slice_bit_exact() -> None:
    batch = 4
    x, y = load_fashion_mnist("train")
    x, y = x[: 3 * batch], y[: 3 * batch]
    progs = []
    for target in ("reference", "c"):
        torch.manual_seed(0)
        opt = mexc.SGD(lr=0.05, momentum=0.9)
        progs.append(
            mexc.compile(
                PoolDropNet(), (torch.zeros(batch, 1, 28, 28),), optimizer=opt, target=target
            )
        )
    ref, c = progs
    ops = {n.op for n in ref.graph.nodes}
    assert {Op.AVGPOOL2D_GRAD, Op.DROPOUT_GRAD, Op.SLICE_GRAD} <= ops
    for _ in range(2):
        ref.replay((x, y), 3)
        c.replay((x, y), 3)
        assert c.state_checksum() == ref.state_checksum()
    assert np.array_equal(c.predict(x), ref.predict(x))


def test_every_executor_op_has_a_c_lowering() -> None:
    from mexc.ir import Op
    from mexc.ops import REGISTRY

    # all_reduce exists only in a data-parallel program, which the C target refuses (one worker)
    missing = [
        o.value
        for o, d in REGISTRY.items()
        if d.supports("reference") > d.supports("c") and o is not Op.ALL_REDUCE
    ]
    assert not missing, missing
    for d in REGISTRY.values():  # every named emitter exists
        assert d.lowering("c") is not None or not d.supports("c")


@pytest.mark.mcu
@pytest.mark.skipif(shutil.which("qemu-system-arm") is None, reason="qemu-system-arm missing")
def test_vit_on_cortex_m3_matches_reference_after_10_steps(tmp_path: Path) -> None:
    x, y = load_fashion_mnist("train")
    data = (x[:8], y[:8])
    prog = _model("ViTTiny", 4)
    project = mexc.export(prog, tmp_path / "vit", data=data, steps=10)
    prog.replay(data, 10)
    run = subprocess.run(
        ["make", "-s", "-C", str(project), "run-qemu"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    states = [
        ln.split()[1] for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("STATE ")
    ]
    assert states == [prog.state_checksum()]


def test_an_unread_result_is_not_emitted() -> None:
    """A chunk whose second half nothing reads: plan-memory gives it no bytes, and the C step
    skips its node instead of failing on the missing slot (the state is unaffected)."""
    from torch import nn

    class HalfUsed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first, _ = self.fc1(torch.flatten(x, 1)).chunk(2, dim=1)
            return self.fc2(first)

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 4)
    progs = []
    for target in ("reference", "c"):
        torch.manual_seed(0)
        progs.append(mexc.compile(HalfUsed(), (torch.from_numpy(x),), target=target))
    for _ in range(3):
        for p in progs:
            p.step(x, y)
        assert progs[0].state_checksum() == progs[1].state_checksum()


def test_a_max_pool_on_the_input_writes_no_window_offsets() -> None:
    """A max pool whose input needs no gradient: no backward reads its window offsets, plan-memory
    gives them no slot, and the C step passes NULL for them (found by bench/fuzz.py)."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 4)
    progs = []
    for target in ("reference", "c"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3))
        progs.append(mexc.compile(model, (torch.from_numpy(x),), target=target))
    for _ in range(2):
        for p in progs:
            p.step(x, y)
        assert progs[0].state_checksum() == progs[1].state_checksum()
