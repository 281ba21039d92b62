"""target="llvm": the whole training step compiled by TVM for the host CPU is bit-exact with the
reference executor (state checksums after every step, losses, predictions), for every CNN
example and for hypothesis-generated random models; the compiled step is cached on disk."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mexc
from mexc.backends.llvm import step as llvm_step
from mexc.backends.llvm.products import HostCpu, host_cpu
from mexc.errors import UnsupportedOpError
from tests.compiler.helpers import EXAMPLES
from tests.compiler.test_fuzz import models as random_models


def _optimizer() -> mexc.SGD:
    return mexc.SGD(
        lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, warmup_steps=2)
    )


def _pair(module_factory, batch: int, shape: tuple[int, ...], **kw) -> tuple:
    torch.manual_seed(0)
    ref = mexc.compile(
        module_factory(), (torch.zeros(batch, *shape),), optimizer=_optimizer(), **kw
    )
    torch.manual_seed(0)
    llvm = mexc.compile(
        module_factory(), (torch.zeros(batch, *shape),), optimizer=_optimizer(), target="llvm", **kw
    )
    return ref, llvm


def _assert_same_training(ref, llvm, x: np.ndarray, y: np.ndarray, steps: int) -> None:
    assert llvm.state_checksum() == ref.state_checksum()
    for step in range(steps):
        assert llvm.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert llvm.state_checksum() == ref.state_checksum(), f"state differs after step {step}"
    assert np.array_equal(llvm.predict(x), ref.predict(x))


@pytest.mark.parametrize(
    "name,batch", [("FashionCNN", 4), ("DigitsCNN", 8), ("SmallResNet", 2), ("MobileNetV2Tiny", 2)]
)
def test_examples_train_ten_steps_bit_exact(name: str, batch: int) -> None:
    cls, shape = EXAMPLES[name]
    ref, llvm = _pair(cls, batch, shape)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    _assert_same_training(ref, llvm, x, y, steps=10)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_mlp_bit_exact_with_either_rounding_and_per_tensor_velocity(rounding: str) -> None:
    cls, shape = EXAMPLES["MLP"]
    ref, llvm = _pair(cls, 16, shape, rounding=rounding, per_group_velocity=False, bits=6)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    _assert_same_training(ref, llvm, x, y, steps=5)


@settings(max_examples=4, deadline=None)
@given(model=random_models(), seed=st.integers(0, 2**16))
def test_random_models_bit_exact(model: nn.Module, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    ref = mexc.compile(model, (x,), seed=seed)
    llvm = mexc.compile(model, (x,), seed=seed, target="llvm")
    _assert_same_training(ref, llvm, x, y, steps=3)


def test_batch_norm_of_constant_channels_is_bit_exact() -> None:
    """An all-zero batch: every channel reaching the batch norms is constant up to stochastic
    rounding, and the all-zero xhat groups lie above the common exponent (compact_common's
    negative shift of an all-zero group, docs/numerics.md section 5; the fuzz campaign's
    crash of issue 29). The reference and the compiled step both keep them 0."""

    def factory() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(4, 16, 1, groups=4),
            nn.Conv2d(16, 16, 1, bias=False),
            nn.BatchNorm2d(16),
            nn.BatchNorm2d(16),
            nn.Flatten(),
            nn.Linear(16, 3),
        )

    ref, llvm = _pair(factory, 16, (4, 1, 1), seed=1)
    x = np.zeros((16, 4, 1, 1), np.float32)
    y = np.random.default_rng(1).integers(0, 3, 16)
    _assert_same_training(ref, llvm, x, y, steps=3)


def test_norms_of_a_variance_far_below_eps_are_bit_exact() -> None:
    """Inputs at 1e-9: every batch- and layer-norm variance lies far below eps, so var + eps is
    summed above the variance's exponent (docs/layers.md, BatchNorm step 4); the compiled
    step's rstd and the reference's agree, and the normalized values stay near 0 as in float."""

    def factory() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Flatten(),
            nn.LayerNorm(8 * 16),
            nn.Linear(8 * 16, 4),
        )

    ref, llvm = _pair(factory, 8, (3, 4, 4), seed=3)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 3, 4, 4)) * 1e-9).astype(np.float32)
    y = rng.integers(0, 4, 8)
    _assert_same_training(ref, llvm, x, y, steps=3)


TINY_IMAGES = {
    # a 3x3 padded convolution of a 1x1 image: every tap outside it is the pack's zero border,
    # so the pack keeps no range test (cpu_gemm._pack had none to combine)
    "conv3x3 of 1x1": (
        lambda: nn.Sequential(
            nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4, 3)
        ),
        (4, 1, 1),
    ),
    # a depthwise 1x1 stride-2 convolution to a 1x1 output: one element per plane
    "depthwise 1x1/2 of 2x2": (
        lambda: nn.Sequential(nn.Conv2d(4, 4, 1, 2, groups=4), nn.Flatten(), nn.Linear(4, 3)),
        (4, 2, 2),
    ),
}


@pytest.mark.parametrize("name", list(TINY_IMAGES))
def test_convolutions_of_tiny_images_are_bit_exact(name: str) -> None:
    """Geometries bench/fuzz.py found: a crash of the llvm build and wrong llvm sums."""
    factory, shape = TINY_IMAGES[name]
    ref, llvm = _pair(factory, 8, shape)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, *shape)) * 100).astype(np.float32)
    y = rng.integers(0, 3, 8)
    _assert_same_training(ref, llvm, x, y, steps=2)


def test_second_compile_comes_from_the_cache_and_the_key_follows_the_program(tmp_path, monkeypatch):
    monkeypatch.setattr(llvm_step, "CACHE", tmp_path)
    cls, shape = EXAMPLES["MLP"]
    _pair(cls, 8, shape)
    assert len(list(tmp_path.glob("llvm-*/plan.json"))) == 1
    t0 = time.perf_counter()
    _, again = _pair(cls, 8, shape)
    assert time.perf_counter() - t0 < 20  # no TE, no TVM: trace, passes, load
    assert len(list(tmp_path.glob("llvm-*/plan.json"))) == 1
    _pair(cls, 8, shape, seed=3)  # the seed reaches the kernels as run-time keys: same entry
    assert len(list(tmp_path.glob("llvm-*/plan.json"))) == 1
    _pair(cls, 4, shape)  # another batch: another IR, another entry
    assert len(list(tmp_path.glob("llvm-*/plan.json"))) == 2
    x = np.random.default_rng(0).standard_normal((8, *shape)).astype(np.float32)
    assert np.isfinite(again.step(x, np.arange(8) % 10))


def test_programs_share_the_kernels_they_have_in_common(tmp_path, monkeypatch):
    """Another momentum changes only the update kernels: the second program compiles those
    and takes the rest from the kernel store, and both train bit-exact."""
    from mexc.backends.llvm.float_check import launch_symbols

    monkeypatch.setattr(llvm_step, "CACHE", tmp_path)
    index = tmp_path / "llvm-kernels" / "index"
    cls, shape = EXAMPLES["MLP"]
    pairs = []
    for momentum in (0.9, 0.5):
        opt = mexc.SGD(lr=0.05, momentum=momentum, weight_decay=5e-4)
        progs = []
        for target in ("reference", "llvm"):
            torch.manual_seed(0)
            progs.append(
                mexc.compile(cls(), (torch.zeros(8, *shape),), optimizer=opt, target=target)
            )
        pairs.append(progs)
        if momentum == 0.9:
            first = {p.name for p in index.iterdir()}
    names = [set(launch_symbols(llvm._plan_json)) for _, llvm in pairs]
    assert names[0] == first and {p.name for p in index.iterdir()} == names[0] | names[1]
    assert 0 < len(names[1] - names[0]) < len(names[1]) / 2  # only the update kernels are new
    x = np.random.default_rng(0).standard_normal((8, *shape)).astype(np.float32)
    for ref, llvm in pairs:
        _assert_same_training(ref, llvm, x, np.arange(8) % 10, steps=2)


def test_unsupported_op_names_the_node_and_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from examples.vit import ViTTiny
    from mexc.ir import Op
    from mexc.ops import REGISTRY

    # every op is lowered now: take the TIR lowering of one away to see the refusal
    d = REGISTRY[Op.SOFTMAX]
    lower = {k: v for k, v in d.lower.items() if k != "tir"}
    monkeypatch.setitem(REGISTRY, Op.SOFTMAX, dataclasses.replace(d, lower=lower))
    torch.manual_seed(0)
    with pytest.raises(UnsupportedOpError) as err:
        mexc.compile(ViTTiny(depth=1), (torch.zeros(2, 1, 28, 28),), target="llvm")
    text = str(err.value)
    assert "not lowered to TVM yet" in text and "target='reference'" in text and "%" in text


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setattr(llvm_step, "CACHE", first)
    cls, shape = EXAMPLES["MLP"]
    ref, _ = _pair(cls, 8, shape)
    shutil.copytree(first, second)  # a copy this process never loaded (the first is mapped)
    parts = list((second / "llvm-kernels" / "parts").glob("*.so"))
    assert parts
    for part in parts:
        part.write_bytes(b"not a shared library")
    monkeypatch.setattr(llvm_step, "CACHE", second)
    _, llvm = _pair(cls, 8, shape)
    assert "rebuilding the damaged cache entry" in capsys.readouterr().err
    x = np.random.default_rng(0).standard_normal((8, *shape)).astype(np.float32)
    y = np.arange(8) % 10
    _assert_same_training(ref, llvm, x, y, steps=2)


def test_a_library_that_lacks_its_kernels_is_rebuilt(tmp_path, monkeypatch, capsys):
    """A part that loads but lacks the kernels the entry names (replaced by another part): the
    entry and those kernels' index entries are dropped, and they are compiled again."""
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setattr(llvm_step, "CACHE", first)
    cls, shape = EXAMPLES["MLP"]
    ref, _ = _pair(cls, 8, shape)
    shutil.copytree(first, second)  # a copy this process never loaded
    parts = sorted((second / "llvm-kernels" / "parts").glob("*.so"))
    assert len(parts) >= 2
    shutil.copyfile(parts[1], parts[0])
    monkeypatch.setattr(llvm_step, "CACHE", second)
    _, llvm = _pair(cls, 8, shape)
    assert "kernels missing from their libraries" in capsys.readouterr().err
    x = np.random.default_rng(0).standard_normal((8, *shape)).astype(np.float32)
    _assert_same_training(ref, llvm, x, np.arange(8) % 10, steps=2)


class _StridedConvs(nn.Module):
    """Strided convolutions whose input gradients the plan builds by output phase: a 1x1 at
    stride 2 (three of four phases have no tap, their dx is 0), a 5x3 kernel strided along one
    axis only, and stride 4 (sixteen phases: the merge once grew as 2^phases and took two
    minutes to compile). The 3x3 stride-2 cases, plain and depthwise, are SmallResNet's and
    MobileNetV2Tiny's above."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # 16x16: the next has an input grad
        self.point = nn.Conv2d(4, 6, 1, stride=2, bias=False)  # -> 8x8
        self.tall = nn.Conv2d(6, 5, (5, 3), stride=(2, 1), padding=(2, 1), bias=False)  # -> 4x8
        self.wide = nn.Conv2d(5, 3, 4, stride=4, padding=1, bias=False)  # -> 1x2
        self.fc = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.point(self.stem(x)))
        x = self.wide(torch.relu(self.tall(x)))
        return self.fc(torch.flatten(x, 1))


def test_strided_input_gradients_by_phase_are_bit_exact() -> None:
    ref, llvm = _pair(_StridedConvs, 3, (1, 16, 16))
    merges = [s for s, _ in llvm.plan["launches"] if s.endswith("_dx_merge_apply")]
    assert len(merges) == 3  # the sub-pixel form serves every strided input gradient
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 1, 16, 16)).astype(np.float32)
    _assert_same_training(ref, llvm, x, np.array([1, 4, 9]), steps=2)


@pytest.mark.parametrize("kernel", ["int32", "avx2_i8"])
def test_the_gemms_of_other_hosts_are_bit_exact_too(kernel: str) -> None:
    """This machine picks the host's byte-product GEMM (vpdpbusd on a VNNI host); a host
    without AVX2 (e.g. aarch64, or an SSE-only x86) gets the int32 tile, built here for SSE 4.2
    with 4 lanes, and an AVX2 host without VNNI the AVX2 byte kernel."""
    host = host_cpu()
    if kernel == "avx2_i8" and host.gemm_kernel == "int32":
        pytest.skip("this host has no AVX2")
    features = {"sse4_2"} if kernel == "int32" else host.features - {"avx512_vnni", "avx_vnni"}
    cpu = HostCpu("x86_64", frozenset(features))
    assert cpu.gemm_kernel == kernel and cpu.gemm_lanes == (4 if kernel == "int32" else 8)
    torch.manual_seed(0)
    ref = mexc.compile(_StridedConvs(), (torch.zeros(3, 1, 16, 16),), optimizer=_optimizer())
    llvm = llvm_step.LlvmProgram(ref.retargeted("llvm"), cpu=cpu)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 1, 16, 16)).astype(np.float32)
    _assert_same_training(ref, llvm, x, np.array([2, 0, 7]), steps=2)


class _AvgPools(nn.Module):
    """Average pools of both backward forms: tiling windows (2x2 stride 2 over an odd 7x7, the
    last row and column in no window; a global 3x3) and overlapping ones (3x3 stride 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.tiled = nn.AvgPool2d(2, 2)
        self.overlapping = nn.AvgPool2d(3, 2)
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        x = self.tiled(x) + self.overlapping(x)  # 7x7 -> 3x3, both
        return self.fc(torch.flatten(nn.functional.avg_pool2d(x, 3), 1))  # global


def test_average_pool_gradients_of_tiling_and_overlapping_windows_are_bit_exact() -> None:
    ref, llvm = _pair(_AvgPools, 3, (1, 7, 7))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 1, 7, 7)).astype(np.float32)
    _assert_same_training(ref, llvm, x, np.array([3, 1, 5]), steps=3)


def test_a_step_stopped_part_way_refuses_its_torn_state() -> None:
    """Ctrl-C between two kernels of a step: the kernels that ran had written the state, so
    the program refuses to step, predict or report that state until one is loaded whole."""
    cls, shape = EXAMPLES["MLP"]  # the kernels of the test above (its kernel cache entries)
    ref, llvm = _pair(cls, 16, shape, per_group_velocity=False, bits=6)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    assert llvm.step(x, y) == ref.step(x, y)
    calls = llvm._calls

    def interrupt() -> None:
        raise KeyboardInterrupt

    llvm._calls = [*calls[:-2], (interrupt, ())]  # every kernel but the last two ran
    with pytest.raises(KeyboardInterrupt):
        llvm.step(x, y)
    llvm._calls = calls
    for use in (lambda: llvm.step(x, y), lambda: llvm.predict(x), llvm.state_checksum):
        with pytest.raises(mexc.TornStateError, match=r"step 1\) stopped part way"):
            use()
    llvm.load_state_dict(ref.state_dict())  # the state after step 1, written whole
    assert llvm.step(x, y) == ref.step(x, y)
    assert llvm.state_checksum() == ref.state_checksum()
