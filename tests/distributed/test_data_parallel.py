"""Data-parallel training (docs/distributed.md): N workers on localhost (gloo) end every step
with the state of one process training on the whole batch, bit for bit; a crashed worker gives
the others a clear error, not a hang; a checkpoint resumes on another number of workers."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import mexc
from mexc.cli import main as mexc_main
from mexc.distributed import launch
from mexc.errors import DistributedError, UnsupportedOpError
from tests.distributed.dp_worker import TOKENS, batches, model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

WORKER = Path(__file__).with_name("dp_worker.py")
MODELS = ("FashionCNN", "DigitsCNN", "SmallResNet", "MobileNetV2Tiny", "MLP")
# at 2 workers besides: a ViT (LayerNorm, attention, GELU, token mean), torchvision's
# MobileNetV3 (hardswish, squeeze-excitation products, hardsigmoid, dropout) and the layers
# added for models users bring (dp_worker.ZooLayers: GroupNorm, LeakyReLU, channel dropout, ...;
# a Swin block's relative-position bias and window mask, gathered; token ids through embedding
# tables; a causal language model's label per position; a padding mask of the ids)
OTHERS = (
    "ViTTiny",
    "mobilenet_v3_small",
    "zoo_layers",
    "shifted_windows",
    "tokens",
    "causal_lm",
    "padded",
)
BATCH, STEPS = 8, 10


@functools.cache
def one_process(
    name: str,
    steps: int = STEPS,
    bits: int = 8,
    optimizer: str = "sgd",
    trainable: str | None = None,
    channels: bool = False,
) -> dict[str, object]:
    """The single-process run the workers must reproduce (once per model and options)."""
    net, shape = model(name)
    data = batches(shape, BATCH, steps, TOKENS.get(name, (0, ())))
    x0 = torch.from_numpy(data[0][0])
    prog = mexc.compile(
        net,
        (x0,),
        bits=bits,
        optimizer=optimizer,
        trainable=trainable,
        channel_exponents=channels,
    )
    losses = [prog.step(x, y) for x, y in data]
    return {"checksum": prog.state_checksum(), "losses": losses}


def run_workers(
    tmp: Path, nproc: int, *args: str, timeout_s: float = 60
) -> tuple[list[int], list[dict[str, dict]]]:
    cmd = [sys.executable, str(WORKER), "--out", str(tmp), *args]
    codes = launch(cmd, nproc, timeout_s=timeout_s)
    return codes, [json.loads(p.read_text()) for p in sorted(tmp.glob("rank*.json"))]


# 3 steps: each changes the state (momentum, running statistics), and every model's workers
# start once per job (the 2-worker job trains all of MODELS and OTHERS); 4 workers: the llvm
# runs below (their shares of the batch the reference's rules, the same one_process states)
@pytest.mark.parametrize(("nproc", "models", "steps"), [(2, MODELS + OTHERS, 3)])
def test_workers_reproduce_one_process(
    tmp_path: Path, nproc: int, models: tuple[str, ...], steps: int
) -> None:
    codes, ranks = run_workers(tmp_path, nproc, "--model", ",".join(models), "--steps", str(steps))
    assert codes == [0] * nproc
    assert len(ranks) == nproc
    for name in models:
        want = one_process(name, steps)
        for got in ranks:
            assert got[name] == want, (name, got[name]["checksum"], want["checksum"])


# the llvm backend's steps: host collectives between its kernels, 3 steps each, as the
# reference's above (one_process runs once per model for both). Every example CNN once, at 2
# or 4 workers: batch norm and the residual sums at 4 (SmallResNet), depthwise convolutions at
# 2; the ViT's (LayerNorm, attention) at 2 in the channel exponents' test below. Compiling the
# kernels takes most of the time (the workers of a job build each cache entry once:
# kernel_cache.entry_lock), so each model is compiled for one number of workers
LLVM_RUNS = [
    (2, ("DigitsCNN", "MobileNetV2Tiny"), 3),
    (4, ("FashionCNN", "SmallResNet"), 3),
]


@pytest.mark.parametrize(("nproc", "models", "steps"), LLVM_RUNS)
def test_llvm_workers_reproduce_one_process(
    tmp_path: Path, nproc: int, models: tuple[str, ...], steps: int
) -> None:
    args = ("--model", ",".join(models), "--steps", str(steps), "--target", "llvm")
    codes, ranks = run_workers(tmp_path, nproc, *args, timeout_s=600)
    assert codes == [0] * nproc
    for name in models:
        want = one_process(name, steps)
        for got in ranks:
            assert got[name] == want, (name, got[name]["checksum"], want["checksum"])


# the CUDA step's own kernels, emulated on the CPU (no GPU here), with its collectives between
# them: a residual network with batch norm (FashionCNN: the GPU check's, below; the ViT's
# collectives, the same all_max and all_sum, run between llvm kernels in LLVM_RUNS)
CUDA_MODELS = ("SmallResNet",)


@needs_cuda_tools
def test_emulated_cuda_workers_reproduce_one_process(tmp_path: Path) -> None:
    args = ("--model", ",".join(CUDA_MODELS), "--steps", "2", "--target", "cuda-emulated")
    codes, ranks = run_workers(tmp_path, 2, *args, timeout_s=600)
    assert codes == [0, 0]
    for name in CUDA_MODELS:
        want = one_process(name, 2)
        for got in ranks:
            assert got[name] == want, (name, got[name]["checksum"], want["checksum"])


@needs_cuda_tools
def test_the_gpu_data_parallel_check_passes_emulated_and_fails_on_other_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/gpu_dp_check.py, the script a GPU machine runs (bench/gpu_check.sh): prepared
    here, its 2 workers run the FashionCNN worker artifact emulated on the CPU, bit-exact with
    one process; an expectation of other bits fails it (the same workers' results: the second
    check replays what the first one's workers wrote instead of starting them again)."""
    import mexc.distributed

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_dp_check

    ran: list[tuple[list[int], dict[str, str]]] = []

    def launch_once(cmd: list[str], nproc: int, **kw: float) -> list[int]:
        out = Path(cmd[cmd.index("--worker") + 1])
        if not ran:
            codes = launch(cmd, nproc, **kw)
            ran.append((codes, {p.name: p.read_text() for p in out.glob("rank*.json")}))
        codes, files = ran[0]
        for name, text in files.items():
            (out / name).write_text(text)
        return codes

    monkeypatch.setattr(mexc.distributed, "launch", launch_once)
    folder = tmp_path / "dp"
    gpu_dp_check.prepare(folder, ("sm_80",))
    assert gpu_dp_check.check(folder, emulate=True) == 0
    expected = json.loads((folder / "expected.json").read_text())
    expected["checksum"] = "0" * 16
    (folder / "expected.json").write_text(json.dumps(expected))
    assert gpu_dp_check.check(folder, emulate=True) == 1
    assert len(ran) == 1


def test_low_bits_with_nearest_forward_rounding(tmp_path: Path) -> None:
    """B = 6 rounds the forward pass to nearest and the rest stochastically (two contexts)."""
    codes, ranks = run_workers(tmp_path, 2, "--model", "FashionCNN", "--bits", "6")
    assert codes == [0, 0]
    want = one_process("FashionCNN", bits=6)
    assert [r["FashionCNN"] for r in ranks] == [want, want]


@pytest.mark.parametrize(
    ("target", "names"),
    [("reference", ("FashionCNN", "SmallResNet")), ("llvm", ("SmallResNet", "ViTTiny"))],
)
def test_channel_exponents_agree_on_the_channel_maxima(
    tmp_path: Path, target: str, names: tuple[str, ...]
) -> None:
    """B = 4 with channel exponents (numerics §5): the workers take each channel's maximum
    over every worker's rows, as the single process does (batch norm, residual sums; on llvm
    the channel maxima are a host collective between the kernels, and the ViT's linear layers
    round per feature)."""
    args = ("--model", ",".join(names), "--bits", "4", "--channel-exponents", "--steps", "3")
    codes, ranks = run_workers(tmp_path, 2, *args, "--target", target, timeout_s=600)
    assert codes == [0, 0]
    for name in names:
        want = one_process(name, 3, bits=4, channels=True)
        assert want != one_process(name, 3, bits=4)
        assert [r[name] for r in ranks] == [want, want], name


def test_adamw_and_sparse_update(tmp_path: Path) -> None:
    """The optimizer and the frozen layers do not read the batch: they split unchanged."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    codes, ranks = run_workers(first, 2, "--steps", "4", "--optimizer", "adamw")
    assert codes == [0, 0]
    want = one_process("FashionCNN", 4, optimizer="adamw")
    assert [r["FashionCNN"] for r in ranks] == [want, want]
    codes, ranks = run_workers(second, 2, "--steps", "4", "--trainable", "last:1")
    assert codes == [0, 0]
    want = one_process("FashionCNN", 4, trainable="last:1")
    assert [r["FashionCNN"] for r in ranks] == [want, want]


def test_checkpoint_resumes_on_another_number_of_workers(tmp_path: Path) -> None:
    ckpt = tmp_path / "half.ckpt"
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    codes, _ = run_workers(first, 2, "--steps", "5", "--save", str(ckpt))
    assert codes == [0, 0]
    codes, ranks = run_workers(second, 4, "--steps", str(STEPS), "--resume", str(ckpt))
    assert codes == [0] * 4
    want = one_process("FashionCNN")
    assert {r["FashionCNN"]["checksum"] for r in ranks} == {want["checksum"]}
    # and in one process: the checkpoint holds the whole program, not a worker's share
    prog = mexc.load(ckpt)
    net, shape = model("FashionCNN")
    for x, y in batches(shape, BATCH, STEPS)[5:]:
        prog.step(x, y)
    assert prog.state_checksum() == want["checksum"]


def test_a_crashed_worker_stops_the_others_with_a_clear_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    codes, _ = run_workers(tmp_path, 2, "--steps", "5", "--crash-rank", "1")
    assert codes[1] == 3 and codes[0] != 0
    err = capfd.readouterr().err
    assert "DistributedError: data-parallel worker 0 of 2" in err
    assert "Another worker stopped" in err


@pytest.mark.parametrize(
    ("differ", "words"),
    [("init", "start from different states (worker(s) [1]"), ("seed", "compiled different")],
)
def test_workers_that_start_apart_are_refused_at_compile(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], differ: str, words: str
) -> None:
    """Other initial weights (torch seeded otherwise before the model was built) or another
    mexc seed: the workers trained apart, each to its own state, without a word."""
    codes, _ = run_workers(tmp_path, 2, "--model", "MLP", "--steps", "1", "--differ", differ)
    assert codes != [0, 0]
    assert f"the data-parallel workers {words}" in capfd.readouterr().err


def test_a_terminated_launcher_stops_its_workers(tmp_path: Path) -> None:
    """SIGTERM to the launcher (a scheduler's stop): the workers end with it, instead of
    training on and writing checkpoints."""
    import subprocess
    import time

    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys\n"
        "from mexc.distributed import launch\n"
        "launch([sys.executable, '-c', 'import time; time.sleep(120)'], 2)\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=str(root))
    )
    time.sleep(3)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 2
    proc.terminate()
    proc.wait(timeout=30)
    time.sleep(0.5)
    assert not [c for c in children if Path(f"/proc/{c}").exists()]


def test_launch_passes_the_environments_timeout(tmp_path: Path) -> None:
    """MEXC_DIST_TIMEOUT set by the user reaches workers that `mexc train --nproc` starts."""
    out = tmp_path / "timeout"
    code = (
        f"import os; open({str(out)!r} + os.environ['RANK'], 'w')"
        ".write(os.environ['MEXC_DIST_TIMEOUT'])"
    )
    assert launch([sys.executable, "-c", code], 2, env=dict(os.environ, MEXC_DIST_TIMEOUT="7")) == [
        0,
        0,
    ]
    assert [(tmp_path / f"timeout{r}").read_text() for r in range(2)] == ["7.0", "7.0"]


def test_without_a_process_group_compile_says_how_to_start_workers() -> None:
    net, shape = model("MLP")
    with pytest.raises(DistributedError, match="torchrun --nproc-per-node"):
        mexc.compile(net, (torch.zeros(8, *shape),), data_parallel=True)


def test_the_c_target_refuses_workers() -> None:
    net, shape = model("MLP")
    with pytest.raises(DistributedError, match="not 'c': a microcontroller runs one worker"):
        mexc.compile(net, (torch.zeros(8, *shape),), target="c", data_parallel=True)


def test_a_rule_without_data_parallel_keys_is_refused_by_name() -> None:
    """A worker's llvm plan lowers a node that reads the batch only where its rule says which
    tensor each rounding key indexes (the PRNG's global element): a rule that does not (a new
    op's) is refused with the node, its line and the fallback, not run with local indices."""
    from mexc.distributed import Workers
    from mexc.lowering.devices import device_of
    from mexc.lowering.step_plan import PlanRules
    from mexc.targets import worker_program

    net, shape = model("FashionCNN")
    whole = mexc.compile(net, (torch.zeros(8, *shape),))
    worker = worker_program(whole, Workers(0, 2, None))  # type: ignore[arg-type]
    builder = PlanRules(worker, 8, device_of("cpu"))
    conv = next(n for n in worker.graph.nodes if n.op.value == "conv2d_compact")
    builder.rows = conv.id in worker.rows_nodes
    assert builder.rows
    with pytest.raises(
        UnsupportedOpError,
        match=r"node %\d+ `conv2d_compact` at \S+\.py:\d+: its compiled rule does not split over 2 "
        r"data-parallel workers yet.*target='reference'",
    ):
        builder.keys(conv, (0,), "key0")
    assert builder.keys(conv, (0,), "key0", 6272)  # told: the key's tensor has 6272 elements
    assert builder.plan.key_rows[-1] == 6272


def test_a_worker_plan_counts_the_whole_batch() -> None:
    """The shift caps of sums over the batch count every worker's rows: at a global batch of
    256, FashionCNN's weight gradients sum 200,704 terms (cap < 0: dy is pre-shifted), and a
    worker of 2, which holds 100,352 of them, pre-shifts the same operands (plans only)."""
    from mexc.distributed import Workers
    from mexc.lowering.devices import device_of
    from mexc.lowering.step_plan import plan_builder
    from mexc.program import Program
    from mexc.targets import worker_program

    net, shape = model("FashionCNN")
    whole = mexc.compile(net, (torch.zeros(256, *shape),))
    worker = worker_program(whole, Workers(0, 2, None))  # type: ignore[arg-type]

    def pre_shifted(prog: Program) -> set[str]:
        b = plan_builder(prog, 8, device_of("cpu"), "int32", None, {})
        return {k for k in b.plan.buffers if k.endswith(".pre3")}

    one = pre_shifted(whole)
    assert one and pre_shifted(worker) == one


def test_mexc_train_nproc_reports_the_one_process_run(tmp_path: Path) -> None:
    """`mexc train --nproc 2 --target llvm`: worker 0 writes the results; the state, the
    losses and the accuracy are one process's (here on the reference)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    args = [
        "train",
        f"{root / 'examples' / 'models.py'}:DigitsCNN",
        "--data",
        "digits",
        "--epochs",
        "1",
        "--batch",
        "16",
        "--limit-train",
        "96",
        "--limit-test",
        "32",
        "--quiet",
    ]
    env = dict(os.environ, PYTHONPATH=str(root))
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}.json"
        if nproc == 1:  # in this process, on the reference
            assert mexc_main([*args, "--target", "reference", "--out", str(out)]) == 0
        else:  # two llvm workers
            cmd = [sys.executable, "-m", "mexc", *args, "--target", "llvm", "--nproc", "2"]
            cmd += ["--out", str(out)]
            subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
        runs[nproc] = json.loads(out.read_text())
    assert runs[2]["config"]["workers"] == 2
    assert runs[2]["integer"]["checksum"] == runs[1]["integer"]["checksum"]
    assert runs[2]["integer"]["accuracy"] == runs[1]["integer"]["accuracy"]
    assert (
        runs[2]["integer"]["history"][0]["step_losses"]
        == (runs[1]["integer"]["history"][0]["step_losses"])
    )
