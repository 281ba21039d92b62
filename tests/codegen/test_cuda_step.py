"""target="cuda": the whole training step built ahead of time (TVM + nvcc, no GPU).

- The GPU variant of the launch plan (GEMM forms, per-shape update kernels) trains bit-exact
  with the reference when its very TIR runs on the host (the llvm "twin").
- Every example model and ResNet-18 build for sm_80 and sm_90 from one lowering: every planned
  kernel is in both cubins, no kernel has a floating-point instruction, every GEMM kernel has
  integer dot products (IDP.4A), every kernel argument is a plan buffer.
- The artifact loads and validates without TVM, torch or networkx; corrupt or foreign artifacts
  are refused with a clear error; running needs CuPy and a GPU (tests marked gpu).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cuda_products import CUDA_TOOLS_REASON, SKIP_CUDA_TOOLS, needs_cuda_tools

import mexc
from examples.models import EXAMPLES
from mexc.backends.cuda.nvcc import ARCHS
from mexc.backends.cuda.runtime import ArtifactError
from mexc.backends.llvm.step import LlvmProgram
from mexc.errors import MexcError
from mexc.numerics import stream_keys
from tests.compiler.test_fuzz import models as random_models

ROOT = Path(__file__).resolve().parents[2]
# built and verified here; DigitsCNN by the CLI in the digits_artifact fixture; SmallResNet,
# MobileNetV2Tiny and ResNet-18 (a minute each) by the CI step `bench/cuda_build.py --check`
# at batch 128, for both architectures: the MLP here; FashionCNN's SASS for both is checked by
# .ci/run's emulation phase (batch 2) and ResNet-18's, whose layers hold its, at batch 128 by
# its build phase
MODELS = {name: EXAMPLES[name] for name in ("MLP",)}


def _optimizer() -> mexc.SGD:
    return mexc.SGD(
        lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, warmup_steps=2)
    )


def _program(factory, batch: int, shape: tuple[int, ...], seed: int = 0) -> mexc.Program:
    torch.manual_seed(0)
    model = factory() if isinstance(factory, type) else factory
    return mexc.compile(model, (torch.zeros(batch, *shape),), optimizer=_optimizer(), seed=seed)


def _trains_like(program: mexc.Program, ref: mexc.Program, steps: int, seed: int = 3) -> None:
    """`program` and `ref` give the same loss and state checksum at every step of a batch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ref.batch, *ref.input_shape)).astype(np.float32)
    y = rng.integers(0, ref.num_classes, ref.batch)
    for step in range(steps):
        assert program.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert program.state_checksum() == ref.state_checksum(), f"state differs after step {step}"


def _twin_matches_reference(factory, batch: int, shape: tuple, steps: int, seed: int = 0) -> None:
    ref = _program(factory, batch, shape, seed)
    _trains_like(LlvmProgram(_program(factory, batch, shape, seed), plan_device="gpu"), ref, steps)


def test_gpu_plan_of_the_fashion_cnn_is_bit_exact_on_the_host() -> None:
    cls, shape = EXAMPLES["FashionCNN"]
    _twin_matches_reference(cls, 4, shape, steps=3)


@settings(max_examples=2, deadline=None)
@given(model=random_models(), seed=st.integers(0, 2**16))
def test_gpu_plan_of_random_models_is_bit_exact_on_the_host(model, seed: int) -> None:
    _twin_matches_reference(model, 4, (1, 8, 8), steps=3, seed=seed)


@pytest.fixture(scope="module")
def digits_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, mexc.Program]:
    """The DigitsCNN (batch 8, its convolutions over batch chunks) built by `mexc compile
    --target cuda` for both architectures,
    and the reference program it holds. Built once per test run: pytest-xdist workers share the
    folder, the first builds it under a lock, the others wait and reuse it."""
    if SKIP_CUDA_TOOLS:
        pytest.skip(CUDA_TOOLS_REASON)
    from mexc.backends.cuda.program import StepArtifact
    from mexc.cli import main

    base = tmp_path_factory.getbasetemp()  # under xdist, its parent is the run's, shared
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "digits-cuda"
    with open(shared / "digits-cuda.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "plan.json").exists():
            args = ["compile", f"{ROOT / 'examples' / 'models.py'}:DigitsCNN"]
            args += ["--input-shape", "1,8,8", "--batch", "8", "--target", "cuda"]
            args += ["--pack-budget", "2048"]  # products over batch chunks (4 of 2 samples)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main([*args, "--out", str(out)]) == 0
            (shared / "digits-cuda.out").write_text(buf.getvalue())
    return out, StepArtifact.load(out).program


def _check_artifact(out: Path, manifest: dict) -> None:
    from mexc.backends.cuda.sass_check import verify_artifact

    assert manifest["gemm"] == "imma" and set(manifest["archs"]) == set(ARCHS)
    assert verify_artifact(out, manifest) == []


@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_build_for_both_archs_integer_only(name: str, tmp_path: Path) -> None:
    from mexc.backends.cuda.build import build_step

    cls, shape = MODELS[name]
    manifest = build_step(_program(cls, 128, shape), ARCHS, tmp_path)
    _check_artifact(tmp_path, manifest)
    on_disk = json.loads((tmp_path / "plan.json").read_text())
    assert on_disk["kernels"] == manifest["kernels"] and on_disk["archs"] == list(ARCHS)


@needs_cuda_tools
def test_artifact_loads_without_tvm_torch_or_networkx(digits_artifact) -> None:
    out, prog = digits_artifact
    code = (
        "import sys\n"
        "for m in ('tvm', 'torch', 'networkx'): sys.modules[m] = None  # imports now fail\n"
        "from mexc.backends.cuda.program import StepArtifact\n"
        f"art = StepArtifact.load({str(out)!r})\n"
        "print(art.archs, art.arch_for('90'), art.arch_for('86'), art.program.state_checksum())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-3:] == ["sm_90", "sm_80", prog.state_checksum()]


def test_the_emulator_infers_with_the_inference_artifact_beside_the_step(digits_artifact) -> None:
    """`mexc compile --target cuda` writes the inference artifact beside the step (inference/);
    the emulator runs its kernels on the step's own state buffers, as the GPU runtime does:
    after two training steps the logits, predictions and accuracy of 11 rows (not a multiple
    of the evaluation batch) are the reference's, in both launch orders."""
    from mexc.backends.cuda.emulator import ORDER_LAYOUT, load_emulated
    from mexc.backends.cuda.program import StepArtifact

    out, _ = digits_artifact
    assert json.loads((out / "plan.json").read_text())["inference"] == "inference"
    rng = np.random.default_rng(11)
    x, y = rng.standard_normal((8, 1, 8, 8)), rng.integers(0, 10, 8)
    xs, ys = rng.standard_normal((11, 1, 8, 8)), rng.integers(0, 10, 11)
    for order, layout in ORDER_LAYOUT.items():
        emu = load_emulated(out, reverse=order == "reverse", layout=layout)
        ref = StepArtifact.load(out).program
        for _ in range(2):
            assert emu.step(x, y) == ref.step(x, y)
        np.testing.assert_array_equal(emu.logits(xs), ref.logits(xs))
        assert emu._inf is not None  # the inference artifact's kernels ran, not the reference
        np.testing.assert_array_equal(emu.predict(xs), ref.predict(xs))
        assert emu.evaluate(xs, ys) == ref.evaluate(xs, ys)
        assert emu.state_checksum() == ref.state_checksum()  # inference changed no state


@needs_cuda_tools
def test_artifact_arch_choice_follows_binary_compatibility(digits_artifact) -> None:
    from mexc.backends.cuda.program import StepArtifact

    art = StepArtifact.load(digits_artifact[0])
    assert [art.arch_for(cc) for cc in ("80", "86", "89", "90")] == ["sm_80"] * 3 + ["sm_90"]
    for cc in ("75", "100", "120"):
        with pytest.raises(ArtifactError, match="compute capability"):
            art.arch_for(cc)


def _tampered(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    man = json.loads((dst / "plan.json").read_text())
    edit(dst, man)
    (dst / "plan.json").write_text(json.dumps(man))
    return dst


@needs_cuda_tools
def test_corrupt_artifacts_are_refused(digits_artifact, tmp_path: Path) -> None:
    from mexc.backends.cuda.program import StepArtifact

    src = digits_artifact[0]

    def flip_cubin(d: Path, man: dict) -> None:
        cubin = d / man["modules"][0]["cubins"]["sm_90"]["file"]
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))

    def unknown_buffer(d: Path, man: dict) -> None:
        man["kernels"][3][4][0] = "nowhere"

    def foreign_arch(d: Path, man: dict) -> None:
        man["archs"] = ["sm_75"]

    def other_program(d: Path, man: dict) -> None:
        (d / "program.mexc").write_bytes(b"not a checkpoint")

    def view_overflow(d: Path, man: dict) -> None:
        name = next(iter(man["views"]))
        man["views"][name][2] = 10**9

    cases = [
        (flip_cubin, "SHA-256"),
        (unknown_buffer, "unknown buffer"),
        (foreign_arch, "sm_75"),
        (other_program, "SHA-256"),
        (view_overflow, "does not fit"),
    ]
    for i, (edit, message) in enumerate(cases):
        bad = _tampered(src, tmp_path / f"bad{i}", edit)
        with pytest.raises(ArtifactError, match=message) as info:
            StepArtifact.load(bad)
        assert "mexc compile" in str(info.value)  # says how to rebuild
    (tmp_path / "bad0" / "plan.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        StepArtifact.load(tmp_path / "bad0")
    with pytest.raises(ArtifactError, match="missing"):
        StepArtifact.load(tmp_path / "nowhere")


def _have_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
        return False


@needs_cuda_tools
def test_running_without_cupy_is_a_clear_error(digits_artifact) -> None:
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    from mexc.backends.cuda.program import load_cuda

    with pytest.raises(MexcError, match="CuPy"):
        load_cuda(digits_artifact[0])


@needs_cuda_tools
@pytest.mark.gpu
@pytest.mark.skipif(not _have_gpu(), reason="needs CuPy and an NVIDIA GPU")
def test_gpu_training_is_bit_exact(digits_artifact) -> None:  # pragma: no cover - GPU only
    from mexc.backends.cuda.program import StepArtifact, load_cuda

    out, _ = digits_artifact
    ref = StepArtifact.load(out).program  # the reference executor on the artifact's program
    gpu = load_cuda(out)
    _trains_like(gpu, ref, steps=5, seed=5)
    x = np.random.default_rng(6).standard_normal((8, *ref.input_shape)).astype(np.float32)
    assert np.array_equal(gpu.predict(x), ref.predict(x))


@needs_cuda_tools
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("reverse,layout", [(False, "arena"), (True, "separate")])
def test_emulated_cuda_training_is_bit_exact(digits_artifact, reverse: bool, layout: str) -> None:
    """The artifact's own CUDA source and launch list, emulated on the CPU (blocks and threads
    in either order; in the GPU runtime's state region and arena, or one guarded allocation per
    buffer), train as the reference does."""
    from mexc.backends.cuda.emulator import load_emulated
    from mexc.backends.cuda.program import StepArtifact

    out, _ = digits_artifact
    emu = load_emulated(out, reverse=reverse, layout=layout)
    _trains_like(emu, StepArtifact.load(out).program, steps=3)


@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@settings(max_examples=2, deadline=None)
@given(model=random_models(), seed=st.integers(0, 2**16))
def test_emulated_cuda_of_random_models_is_bit_exact(model, seed: int) -> None:
    """Random conv / BN / pooling / residual / head models: the CUDA step they build (sm_80,
    batch 2) trains as the reference does when emulated, in reverse order."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import EmulatedCudaProgram
    from mexc.backends.cuda.program import StepArtifact

    with tempfile.TemporaryDirectory() as out:
        build_step(_program(model, 2, (1, 8, 8), seed), ("sm_80",), out, cubins=False)
        artifact = StepArtifact.load(out, sources=True)
        emu = EmulatedCudaProgram(artifact, reverse=True)
        _trains_like(emu, artifact.program, steps=2, seed=seed)


@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_emulated_cuda_under_nearest_forward_rounding_is_bit_exact() -> None:
    """The MLP at B = 6, where the rounding mode `auto` means nearest-forward (forward nodes
    round to nearest, the rest stochastically; docs/numerics.md section 4)."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import EmulatedCudaProgram
    from mexc.backends.cuda.program import StepArtifact

    cls, shape = EXAMPLES["MLP"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(4, *shape),), optimizer=_optimizer(), bits=6)
    assert prog.options.rounding == "nearest-forward"
    with tempfile.TemporaryDirectory() as out:
        build_step(prog, ("sm_80",), out, cubins=False)
        artifact = StepArtifact.load(out, sources=True)
        _trains_like(EmulatedCudaProgram(artifact), artifact.program, steps=3)


@needs_cuda_tools
def test_cli_writes_a_checked_cuda_artifact(digits_artifact) -> None:
    from mexc.backends.cuda.program import StepArtifact

    out, prog = digits_artifact
    printed = (out.parent / "digits-cuda.out").read_text()
    assert "CUDA artifact written" in printed and "sm_80, sm_90" in printed
    art = StepArtifact.load(out)
    assert art.archs == ARCHS and art.program.options.target == "cuda"
    assert art.program.batch == 8 and art.program.state_checksum() == prog.state_checksum()
    _check_artifact(out, art.manifest)


def test_gpu_check_names_the_first_buffer_written_wrong() -> None:
    from mexc.backends.cuda.check import first_difference

    kernels = [
        [0, "k0", [1, 1, 1], [1, 1, 1], ["x", "a"]],
        [0, "k1", [1, 1, 1], [1, 1, 1], ["a", "b"]],
    ]
    want = {"x": "1", "a": "2", "b": "3", "lr": "4"}
    assert first_difference(dict(want), want, kernels) is None
    assert first_difference({**want, "b": "0", "a": "0"}, want, kernels) == "a"
    assert first_difference({**want, "lr": "0"}, want, kernels) == "lr"


def test_gpu_check_times_its_contenders_in_alternating_blocks(monkeypatch) -> None:
    """check.alternated_medians: warm-ups first, then blocks A B C A B C with a pause before
    each block, each block synchronized after every step, until every contender has its
    steps; the median of each contender's own step times."""
    from mexc.backends.cuda import check

    events: list[str] = []
    clock = [0.0]
    cost = {"a": 1.0, "b": 2.0, "c": 3.0}

    def contender(name: str) -> tuple:
        def run() -> None:
            events.append(name)
            clock[0] += cost[name]

        return run, lambda: events.append(f"sync {name}")

    monkeypatch.setattr(check.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(check.time, "sleep", lambda s: events.append(f"pause {s}"))
    got = check.alternated_medians(
        {n: contender(n) for n in "abc"}, steps=4, block=2, pause_s=0.5, warmup=1
    )
    assert got == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert events[:6] == ["a", "sync a", "b", "sync b", "c", "sync c"]  # warm-ups
    timed = events[6:]
    block = lambda n: ["pause 0.5", n, f"sync {n}", n, f"sync {n}"]  # noqa: E731
    assert timed == [*block("a"), *block("b"), *block("c")] * 2


class _FakeArray(np.ndarray):
    """A host array standing in for a CuPy device array (set = host copy)."""

    def set(self, values: np.ndarray, stream: object = None) -> None:
        self[...] = values.reshape(self.shape)


class _FakeCupy:
    """The CuPy surface CudaProgram uses, over numpy, recording kernel launches: it checks the
    runtime's host logic (buffers, views, writes, state round trip, graph capture and replay),
    not the kernels."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple, tuple, tuple[int, ...]]] = []
        self.capturing = False
        self.captures = 0  # stream captures begun
        self.replays = 0  # graph launches
        self.events = 0  # CUDA events recorded
        fake = self

        class Device:
            compute_capability = "90"

            def __init__(self, index: int = 0) -> None:
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self) -> None:
                pass

        class Graph:
            def __init__(self, calls: list) -> None:
                self.calls = calls

            def launch(self, stream: object = None) -> None:
                fake.replays += 1
                fake.launches.extend(self.calls)

        class Stream(Device):
            def __init__(self, non_blocking: bool = False) -> None:
                self.recorded: list = []

            def begin_capture(self) -> None:
                fake.capturing, fake.captured = True, []
                fake.captures += 1

            def end_capture(self) -> Graph:
                fake.capturing = False
                return Graph(fake.captured)

        class Module:
            def __init__(self, path: str) -> None:
                assert Path(path).suffix == ".cubin"

            def get_function(self, symbol: str):
                def launch(grid: tuple, block: tuple, args: tuple) -> None:
                    call = (
                        symbol,
                        grid,
                        block,
                        tuple(a.__array_interface__["data"][0] for a in args),
                    )
                    (fake.captured if fake.capturing else fake.launches).append(call)

                return launch

        class Event:
            def record(self, stream: object = None) -> None:
                assert not fake.capturing
                fake.events += 1

            def synchronize(self) -> None:
                pass

        def get_elapsed_time(start: Event, end: Event) -> float:
            return 0.5  # milliseconds

        self.cuda = type(
            "cuda",
            (),
            {
                "Device": Device,
                "Stream": Stream,
                "Event": Event,
                "get_elapsed_time": staticmethod(get_elapsed_time),
            },
        )
        self.RawModule = Module

    @staticmethod
    def zeros(shape: tuple, dtype: str) -> _FakeArray:
        return np.zeros(shape, dtype).view(_FakeArray)

    @staticmethod
    def asnumpy(a: np.ndarray, stream: object = None) -> np.ndarray:
        return np.array(a)


@needs_cuda_tools
def test_cuda_runtime_host_logic_on_a_fake_cupy(digits_artifact, monkeypatch) -> None:
    import mexc.backends.cuda.program as cuda_program

    out, prog = digits_artifact
    fake = _FakeCupy()
    monkeypatch.setattr(cuda_program, "cupy_module", lambda: fake)
    gpu = cuda_program.load_cuda(out)
    assert gpu.arch == "sm_90" and gpu.state_checksum() == prog.state_checksum()
    plan = gpu.plan
    # a view shares its base buffer's memory, at its element offset
    name, (base, shape, offset) = next((k, v) for k, v in plan["views"].items() if v[2] > 0)
    gpu._t[base].reshape(-1)[offset] = 7
    assert gpu._t[name].reshape(-1)[0] == 7
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = np.arange(8) % 10
    gpu.step(x, y)
    gpu.step(x, y)
    symbols = [k[1] for k in plan["kernels"]]
    assert [c[0] for c in fake.launches] == symbols * 2  # captured once, replayed each step
    first = fake.launches[0]
    want = tuple(gpu._t[a].__array_interface__["data"][0] for a in plan["kernels"][0][4])
    assert first[3] == want and list(first[1]) == plan["kernels"][0][2]
    assert gpu.step_count == 2 and gpu.read_buffer(plan["labels"]).tolist() == y.tolist()
    # two device allocations of the layout's sizes hold every buffer
    layout = plan["layout"]
    assert gpu.allocated_bytes()["device"] == layout["state_bytes"] + layout["arena_bytes"]
    bases = {gpu._t[b].__array_interface__["data"][0] for b in plan["buffers"]}
    assert len(bases) < len(plan["buffers"])  # buffers with disjoint lifetimes share bytes
    keys = gpu.read_buffer(plan["keys"])[: len(plan["key_ids"])]
    assert np.array_equal(keys, stream_keys(0, 1, np.array(plan["key_ids"])))
    gpu.set_graph(False)  # launch by launch: no capture, every kernel launched directly
    fake.captured = []
    gpu.step(x, y)
    assert [c[0] for c in fake.launches] == symbols * 3 and fake.captured == []


def _pointers(gpu) -> dict[str, int]:
    return {name: a.__array_interface__["data"][0] for name, a in gpu._t.items()}


def _planned_launches(gpu) -> list[tuple[str, tuple, tuple, tuple[int, ...]]]:
    """The step as plan.json orders it, bound to `gpu`'s own device buffers."""
    ptr = _pointers(gpu)
    return [
        (symbol, tuple(grid), tuple(block), tuple(ptr[a] for a in args))
        for _, symbol, grid, block, args in gpu.plan["kernels"]
    ]


class _EmulatingCupy(_FakeCupy):
    """The fake CuPy whose modules run their kernels: a cubin's CUDA source (step<i>.cu
    beside it) on the CPU emulator, each launch at once (no graph capture)."""

    def __init__(self) -> None:
        super().__init__()
        from mexc.backends.cuda.emulator import EmulatedModule

        fake = self

        class Module:
            def __init__(self, path: str) -> None:
                cubin = Path(path)
                source = cubin.with_name(cubin.name.split(".")[0] + ".cu")
                self.module = EmulatedModule(source.read_text())
                self.folder = cubin.parent.name

            def get_function(self, symbol: str):
                def launch(grid: tuple, block: tuple, args: tuple) -> None:
                    assert not fake.capturing
                    fake.launches.append((f"{self.folder}/{symbol}", grid, block, ()))
                    self.module.launch(symbol, grid, block, list(args))

                return launch

        self.RawModule = Module


@needs_cuda_tools
def test_cuda_predict_runs_the_inference_artifact_on_the_step_state(
    digits_artifact, monkeypatch
) -> None:
    """`mexc compile --target cuda` builds the inference plan's artifact beside the step
    (inference/); CudaProgram's predict, logits and evaluate launch its kernels on the step's
    own state buffers and arena, bit-exact with the reference after training steps, and the
    steps after them stay bit-exact (run here on a fake CuPy whose kernels are the artifact's
    own CUDA source, emulated)."""
    import mexc.backends.cuda.program as cuda_program
    from mexc.backends.cuda.program import StepArtifact

    out, _ = digits_artifact
    plan = json.loads((out / "plan.json").read_text())
    assert plan["inference"] == "inference"
    inference = StepArtifact.load(out / "inference").manifest
    assert "logits" in inference and set(inference["state"]) < set(plan["state"])
    # the step's program file, not a copy
    assert inference["program_file"] == "../program.mexc"
    assert not (out / "inference" / "program.mexc").exists()
    fake = _EmulatingCupy()
    monkeypatch.setattr(cuda_program, "cupy_module", lambda: fake)
    gpu = cuda_program.load_cuda(out, graph=False)
    ref = StepArtifact.load(out).program
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    for _ in range(2):
        assert gpu.step(x, y) == ref.step(x, y)
    assert gpu.allocated_bytes()["eval_device"] == 0  # nothing until the first predict
    trained = len(fake.launches)
    rows = rng.standard_normal((11, 1, 8, 8)).astype(np.float32)  # two batches, one partial
    assert np.array_equal(gpu.predict(rows), ref.predict(rows))
    symbols = [f"inference/{k[1]}" for k in inference["kernels"]]
    assert [c[0] for c in fake.launches[trained:]] == symbols * 2
    assert np.array_equal(gpu.logits(x), ref.logits(x))
    assert gpu.evaluate(rows, np.arange(11) % 10) == ref.evaluate(rows, np.arange(11) % 10)
    # its own state region (the arena is the step's where that is large enough)
    layout = inference["layout"]
    own = layout["state_bytes"] + (
        layout["arena_bytes"] if layout["arena_bytes"] > plan["layout"]["arena_bytes"] else 0
    )
    assert gpu.allocated_bytes()["eval_device"] == own
    assert gpu.memory_report()["allocated_eval_bytes"] == own
    assert gpu.step(x, y) == ref.step(x, y)
    assert gpu.state_checksum() == ref.state_checksum()


@needs_cuda_tools
def test_cuda_graph_replays_the_launch_by_launch_step_on_a_fake_cupy(
    digits_artifact, monkeypatch
) -> None:
    """Launched kernel by kernel, a step is plan.json's list in order, bound to the program's
    buffers. With graphs, the first step is that list launched directly, the second captures
    the same list once and replays it, later steps only replay; the per-step inputs and
    load_state_dict write into the buffers the graph points at, which never move; kernel_times
    still launches kernel by kernel."""
    import mexc.backends.cuda.program as cuda_program
    from mexc.backends.cuda.program import StepArtifact
    from mexc.kernels.quantize import quantize

    out, prog = digits_artifact
    monkeypatch.delenv("MEXC_CUDA_GRAPH", raising=False)
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8))
        for _ in range(4)
    ]
    eager_fake = _FakeCupy()
    monkeypatch.setattr(cuda_program, "cupy_module", lambda: eager_fake)
    eager = cuda_program.load_cuda(out, graph=False)
    eager.step(*batches[0])
    eager.step(*batches[1])
    assert eager_fake.launches == _planned_launches(eager) * 2 and eager_fake.captures == 0

    fake = _FakeCupy()
    monkeypatch.setattr(cuda_program, "cupy_module", lambda: fake)
    gpu = cuda_program.load_cuda(out)
    assert gpu.use_graph
    pointers, step = _pointers(gpu), _planned_launches(gpu)
    gpu.step(*batches[0])  # launch by launch, no capture yet
    assert (fake.captures, fake.replays) == (0, 0) and fake.launches == step
    gpu.step(*batches[1])  # captured once, then replayed
    assert (fake.captures, fake.replays) == (1, 1) and fake.captured == step
    gpu.load_state_dict(StepArtifact.load(out).program.state_dict())  # in place
    gpu.step(*batches[2])
    gpu.step(*batches[3])
    assert (fake.captures, fake.replays) == (1, 3) and fake.launches == step * 4
    assert _pointers(gpu) == pointers  # no buffer moved: the graph's pointers stay valid
    assert gpu.read_buffer(gpu.plan["input"][0]).tolist() == (
        quantize(batches[3][0], prog.options.bits).m.tolist()
    )
    assert gpu.read_buffer(gpu.plan["labels"]).tolist() == batches[3][1].tolist()
    # kernel timing: one step (a replay), then every kernel alone between two events
    times = gpu.kernel_times(*batches[0], repeats=1)
    assert (fake.captures, fake.replays) == (1, 4) and fake.events == 2 * len(step)
    assert fake.launches == step * 6
    assert len(times) == len(step) and set(times.values()) == {0.5e-3}
    gpu.set_graph(False)  # launch by launch again, no capture
    gpu.step(*batches[0])
    assert (fake.captures, fake.replays) == (1, 4) and fake.launches == step * 7


@needs_cuda_tools
def test_gpu_check_sets_kernel_times_beside_the_roofline(digits_artifact) -> None:
    from mexc.backends.cuda.check import against_roofline
    from mexc.backends.cuda.program import StepArtifact
    from mexc.backends.cuda.roofline import kernel_costs

    man = StepArtifact.load(digits_artifact[0]).manifest
    measured = {f"{i:04d} {k[1]}": (i + 1) * 1e-6 for i, k in enumerate(man["kernels"])}
    groups = against_roofline(man, measured, "H200")
    n = len(man["kernels"])
    assert sum(g["measured_ms"] for g in groups.values()) == pytest.approx(n * (n + 1) / 2e3)
    gemm_ms = sum((c.index + 1) * 1e-3 for c in kernel_costs(man) if c.gemm)
    assert groups["gemm"]["measured_ms"] == pytest.approx(gemm_ms)
    assert all(0 < g["roofline_ms"] <= g["capped_ms"] for g in groups.values())


@needs_cuda_tools
def test_cuda_graph_capture_failure_falls_back_to_launches(digits_artifact, monkeypatch) -> None:
    """A CuPy or driver without stream capture: one note, then kernel by kernel, same list."""
    import mexc.backends.cuda.program as cuda_program

    out, _ = digits_artifact
    fake = _FakeCupy()

    def no_capture(self) -> None:
        raise RuntimeError("stream capture is not supported")

    monkeypatch.setattr(cuda_program, "cupy_module", lambda: fake)
    gpu = cuda_program.load_cuda(out, graph=True)
    monkeypatch.setattr(type(gpu._stream), "begin_capture", no_capture)
    x = np.zeros((8, 1, 8, 8), np.float32)
    y = np.arange(8) % 10
    gpu.step(x, y)
    gpu.step(x, y)
    gpu.step(x, y)
    assert not gpu.use_graph and fake.replays == 0
    assert fake.launches == fake.launches[: len(gpu.plan["kernels"])] * 3


@needs_cuda_tools
def test_the_verifier_finds_float_in_a_kernel_source(digits_artifact, tmp_path: Path) -> None:
    from mexc.backends.cuda.program import StepArtifact
    from mexc.backends.cuda.sass_check import verify_artifact

    bad = tmp_path / "bad"
    shutil.copytree(digits_artifact[0], bad)
    man = StepArtifact.load(bad).manifest
    cu = bad / man["modules"][0]["source"]
    cu.write_text(cu.read_text() + '\nextern "C" __global__ void k(float* x) { x[0] = 0.5f; }\n')
    man["gemm_kernels"] = [*man["gemm_kernels"], "not_a_kernel"]
    problems = verify_artifact(bad, man)
    assert any("float in the kernel source: 'float'" in p for p in problems)


@needs_cuda_tools
def test_device_layout_without_a_build_is_the_artifacts(digits_artifact) -> None:
    """bench/memory.py's CUDA figures come from device_layout: the very layout of the built
    artifact, scratch included."""
    from mexc.backends.cuda.build import device_layout
    from mexc.backends.cuda.program import StepArtifact

    out, _ = digits_artifact
    man = StepArtifact.load(out).manifest
    layout = device_layout(StepArtifact.load(out).program, pack_budget=2048)
    assert layout["state_bytes"] == man["layout"]["state_bytes"]
    assert layout["arena_bytes"] == man["layout"]["arena_bytes"]


@needs_cuda_tools
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_emulated_cuda_pre_shift_of_wide_reductions_is_bit_exact(tmp_path: Path) -> None:
    """A weight gradient and a batch-norm dgamma over 147456 > 2^17 terms: the artifact's own
    CUDA source pre-shifts their operands (sites 3 and 7) and trains as the reference does, in
    the GPU layout and in reverse order with a guarded allocation per buffer."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import load_emulated
    from mexc.backends.cuda.program import StepArtifact
    from tests.codegen.test_plan_layout import WideReductions

    prog = _program(WideReductions, 64, (1, 48, 48))
    man = build_step(prog, ("sm_80",), tmp_path, cubins=False)
    # two pre-shift launches (equal kernels: the dy of both reductions, one compiled symbol)
    assert sum(k[1].endswith(("_pre3_kernel", "_pre7_kernel")) for k in man["kernels"]) == 2
    for reverse, layout in ((False, "arena"), (True, "separate")):
        emu = load_emulated(tmp_path, reverse=reverse, layout=layout)
        _trains_like(emu, StepArtifact.load(tmp_path, sources=True).program, steps=2)


@needs_cuda_tools
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_emulated_cuda_of_the_leanest_step_is_bit_exact(tmp_path: Path) -> None:
    """Every node of the GPU plan at its leanest (convolutions scanned, then rounded, from one
    chunk's padded C; weight gradients in chunks; batch norms without a stored bracket): the
    artifact's own CUDA source trains as the reference does, in both orders."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import load_emulated
    from mexc.backends.cuda.program import StepArtifact
    from mexc.lowering.step_plan import leanest

    prog = _program(EXAMPLES["DigitsCNN"][0], 4, EXAMPLES["DigitsCNN"][1])
    man = build_step(prog, ("sm_80",), tmp_path, lean=leanest(prog, "gpu"), cubins=False)
    assert any("_amax_k" in k[1] for k in man["kernels"])
    for reverse, layout in ((False, "arena"), (True, "separate")):
        emu = load_emulated(tmp_path, reverse=reverse, layout=layout)
        _trains_like(emu, StepArtifact.load(tmp_path, sources=True).program, steps=2)


class _TwinWorker:
    """The collectives of worker 0 of 2 whose twin holds the same values (a maximum is the
    value, a sum twice it), logging each into `log`; with `in_place`, the device path
    (reduce_in_place on the buffer itself, as TorchCollectives does it)."""

    def __init__(self, log: list, in_place: bool) -> None:
        self.log = log
        if in_place:
            self.reduce_in_place = self._reduce_in_place

    def all_max(self, a: np.ndarray) -> np.ndarray:
        self.log.append(("all_max",))
        return np.asarray(a, np.int64)

    def all_sum(self, a: np.ndarray) -> np.ndarray:
        self.log.append(("all_sum",))
        return 2 * np.asarray(a, np.int64)

    def all_gather(self, a: np.ndarray) -> np.ndarray:
        self.log.append(("all_gather",))
        return np.concatenate([a, a]).astype(np.int64)

    def _reduce_in_place(self, buf: np.ndarray, kind: str, stream: object = None) -> None:
        self.log.append((kind, buf.__array_interface__["data"][0], stream))
        if kind == "all_sum":
            buf *= 2


@pytest.fixture(scope="module")
def worker_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, mexc.Program]:
    """The FashionCNN step of worker 0 of 2 (global batch 8) built for sm_90, and the worker
    program (its collectives unset)."""
    if SKIP_CUDA_TOOLS:
        pytest.skip(CUDA_TOOLS_REASON)
    from mexc.backends.cuda.build import build_step
    from mexc.distributed import Workers
    from mexc.targets import worker_program

    cls, shape = EXAMPLES["FashionCNN"]
    worker = worker_program(_program(cls, 8, shape), Workers(0, 2, None))  # type: ignore[arg-type]
    out = tmp_path_factory.mktemp("worker-cuda")
    build_step(worker, ("sm_90",), out)
    return out, worker


@needs_cuda_tools
@pytest.mark.parametrize("in_place", [True, False])
def test_cuda_worker_runs_its_collectives_between_graphs_on_a_fake_cupy(
    worker_artifact, monkeypatch, in_place: bool
) -> None:
    """A worker's step is its kernels with the collectives of plan.json between them, in
    order: on the program's stream, on the device buffer itself where the collectives take
    one (NCCL), else through a host copy. With graphs every run of kernels between two
    collectives is captured once (at the second step) and replayed; the collectives run
    between the replays. An artifact with collectives refuses to run without workers."""
    import mexc.backends.cuda.program as cuda_program
    from mexc.distributed import Workers
    from mexc.errors import DistributedError

    out, worker = worker_artifact
    fake = _FakeCupy()
    monkeypatch.setattr(cuda_program, "cupy_module", lambda: fake)
    monkeypatch.setattr(fake.cuda.Stream, "ptr", 1234, raising=False)
    with pytest.raises(DistributedError, match="data-parallel worker's step.*collectives"):
        cuda_program.load_cuda(out)
    comm = _TwinWorker(fake.launches, in_place)
    prog = mexc.Program(
        worker.graph,
        worker.state,
        worker.options,
        worker.optimizer,
        0,
        Workers(0, 2, comm),  # type: ignore[arg-type]
        worker.global_graph,
    ).retargeted("cuda")
    gpu = cuda_program.CudaProgram(cuda_program.StepArtifact.load(out), program=prog)
    man = gpu.plan
    assert man["collectives"] and all(c[0] < len(man["kernels"]) for c in man["collectives"])
    ptr, kernels = _pointers(gpu), _planned_launches(gpu)
    step: list[tuple] = [("all_max",)]  # the batch's float maximum at the boundary (host)
    done = 0
    for at, kind, name in man["collectives"]:
        step += kernels[done:at]
        step.append((kind, ptr[name], 1234) if in_place else (kind,))
        done = at
    step += kernels[done:]
    step += [("all_gather",)]  # each row's sum and label gap, for the loss
    x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)
    y = np.arange(4)
    runs = sum(1 for calls, _ in cuda_program.segments(man) if len(calls))
    assert runs > 1
    for n in range(3):
        gpu.step(x, y)
        assert fake.launches == step * (n + 1)
        assert (fake.captures, fake.replays) == ((runs, runs * n) if n else (0, 0))
    # a sum replaces the int32 buffer by the twins' (staged: copied out, summed, copied back)
    at, kind, name = next(c for c in man["collectives"] if c[1] == "all_sum")
    gpu._t[name][...] = 3
    gpu._collective(kind, comm, gpu._t[name])()
    assert (gpu._t[name] == 6).all() and gpu._t[name].dtype == np.int32


def test_an_artifact_of_sources_only_runs_on_the_emulator_and_no_gpu_loads_it(
    tmp_path: Path,
) -> None:
    """build_step(cubins=False) writes the CUDA sources without nvcc, for the CPU emulator; a
    GPU's loader refuses it by name."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import compare
    from mexc.backends.cuda.program import StepArtifact

    torch.manual_seed(0)
    prog = mexc.compile(torch.nn.Linear(6, 4), (torch.zeros(4, 6),))
    man = build_step(prog, ("sm_80",), tmp_path, cubins=False)
    assert man["sources_only"] and not list(tmp_path.glob("*.cubin"))
    with pytest.raises(ArtifactError, match="holds CUDA sources only"):
        StepArtifact.load(tmp_path)
    assert all(row["exact"] for row in compare(tmp_path, 2))
