"""Channel exponents (docs/numerics.md §5) in a training program: below 8 bits every activation,
gradient and weight row keeps B bits at its own exponent in the tensor's int8 frame; at 8 bits
the option changes nothing; the targets without a lowering of it refuse it by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import mexc
from examples.models import EXAMPLES
from mexc.errors import UnsupportedOpError
from mexc.numerics import overflow_debug, qmax


def _data(name: str, batch: int = 8, steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, shape = EXAMPLES[name]
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(steps)
    ]


def _program(
    name: str, bits: int, channels: bool, target: str = "reference", optimizer: str = "sgd"
) -> mexc.Program:
    cls, _ = EXAMPLES[name]
    torch.manual_seed(0)
    x0 = _data(name)[0][0]
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4) if optimizer == "sgd" else optimizer
    return mexc.compile(cls(), (x0,), opt, bits=bits, target=target, channel_exponents=channels)


@pytest.mark.parametrize(
    ("name", "optimizer"), [("FashionCNN", "sgd"), ("SmallResNet", "sgd"), ("FashionCNN", "adamw")]
)
def test_low_bit_training_keeps_each_weight_row_at_b_bits_in_the_frame(
    name: str, optimizer: str
) -> None:
    prog = _program(name, 4, True, optimizer=optimizer)
    plain = _program(name, 4, False, optimizer=optimizer)
    losses = [prog.step(x, y) for x, y in _data(name)]
    plain_losses = [plain.step(x, y) for x, y in _data(name)]
    assert all(np.isfinite(losses)) and losses != plain_losses
    wider = 0
    for pname, p in prog.state.items():
        if pname.endswith(("velocity", ".m", ".r", "running_mean", "running_var")) or p.e.ndim:
            continue
        m = p.m.astype(np.int64).reshape(p.m.shape[0], -1) if p.m.ndim else p.m.reshape(1, 1)
        assert np.abs(m).max() <= qmax(4) << 4, pname
        for row in m:  # a B-bit mantissa at the row's own exponent
            nz = row[row != 0]
            if nz.size:
                unit = 1 << int(np.min([(int(v) & -int(v)).bit_length() - 1 for v in nz]))
                assert np.abs(row // unit).max() <= qmax(4), pname
        wider += int(np.abs(m).max() > qmax(4))
    assert wider > 0  # the frame is used: some weights lie above qmax(4)


@pytest.mark.parametrize("name", ["FashionCNN", "SmallResNet", "MobileNetV2Tiny", "MLP"])
def test_the_fast_kernels_round_as_the_checked_numerics(name: str) -> None:
    """Overflow debugging runs numerics.channel_compact itself and the general batch-norm
    kernels; without it the fast kernels run: the same bits."""
    fast, checked = _program(name, 4, True), _program(name, 4, True)
    data = _data(name, steps=3)
    want = [fast.step(x, y) for x, y in data]
    with overflow_debug():
        got = [checked.step(x, y) for x, y in data]
    assert got == want and checked.state_checksum() == fast.state_checksum()


def test_at_8_bits_the_option_changes_nothing() -> None:
    a, b = _program("FashionCNN", 8, True), _program("FashionCNN", 8, False)
    for x, y in _data("FashionCNN", steps=2):
        assert a.step(x, y) == b.step(x, y)
    assert a.state_checksum() == b.state_checksum()
    assert "channel_exponents" not in a.ir.splitlines()[0]


def test_a_checkpoint_keeps_the_option_and_resumes_bit_exact(tmp_path: Path) -> None:
    data = _data("FashionCNN")
    whole = _program("FashionCNN", 4, True)
    for x, y in data:
        whole.step(x, y)
    first = _program("FashionCNN", 4, True)
    for x, y in data[:2]:
        first.step(x, y)
    first.save(tmp_path / "ck")
    resumed = mexc.load(tmp_path / "ck")
    assert resumed.options.channel_exponents
    assert "channel_exponents=true" in resumed.ir.splitlines()[0]  # insert-mx-types' mark
    for x, y in data[2:]:
        resumed.step(x, y)
    assert resumed.state_checksum() == whole.state_checksum()


@pytest.mark.parametrize("target", ["llvm", "c"])
def test_a_target_without_the_lowering_refuses_it_by_name(target: str) -> None:
    with pytest.raises(UnsupportedOpError, match="channel exponents.*reference"):
        _program("FashionCNN", 4, True, target)


def test_auto_falls_back_to_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    prog = _program("FashionCNN", 4, True, "auto")
    assert prog.options.target == "reference"
    assert "channel exponents" in capsys.readouterr().err
