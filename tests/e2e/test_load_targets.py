"""mexc.load restores the target a checkpoint was saved from (c, llvm, cuda), or raises a
CheckpointError that names it and says how to load it elsewhere; target= retargets."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mexc
from mexc.backends.c.host import CProgram
from tests.compiler.helpers import EXAMPLES

ROOT = Path(__file__).resolve().parents[2]
BATCH = 4


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    _, shape = EXAMPLES["MLP"]
    return rng.standard_normal((BATCH, *shape)).astype(np.float32), rng.integers(0, 10, BATCH)


def _trained(target: str, steps: int = 2) -> mexc.Program:
    cls, shape = EXAMPLES["MLP"]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.05, momentum=0.9, schedule=mexc.Cosine(40, warmup_steps=2))
    prog = mexc.compile(cls(), (torch.zeros(BATCH, *shape),), optimizer=opt, target=target)
    x, y = _data()
    for _ in range(steps):
        prog.step(x, y)
    return prog


def _continues_alike(a: mexc.Program, b: mexc.Program) -> None:
    """Same step count and state, and one more step gives the same state and loss (the C
    step reports the loss in thousandths)."""
    assert (a.step_count, a.state_checksum()) == (b.step_count, b.state_checksum())
    x, y = _data()
    assert a.step(x, y) == pytest.approx(b.step(x, y), abs=1e-3)
    assert a.state_checksum() == b.state_checksum()


def _llvm_class() -> type:
    pytest.importorskip("tvm")
    from mexc.backends.llvm.step import LlvmProgram

    return LlvmProgram


@pytest.mark.parametrize("target", ["c", "llvm"])
def test_load_restores_the_saved_target(target: str, tmp_path: Path) -> None:
    cls = CProgram if target == "c" else _llvm_class()
    prog = _trained(target)
    prog.save(tmp_path / "p.mexc")
    loaded = mexc.load(tmp_path / "p.mexc")
    assert type(loaded) is cls and type(prog) is cls
    assert loaded.options == prog.options and loaded.options.target == target
    _continues_alike(loaded, prog)


def test_load_retargets_on_request(tmp_path: Path) -> None:
    prog = _trained("c")
    prog.save(tmp_path / "p.mexc")
    ref = mexc.load(tmp_path / "p.mexc", target="reference")
    assert type(ref) is mexc.Program and ref.options.target == "reference"
    _continues_alike(ref, prog)
    ref.save(tmp_path / "r.mexc")  # saved from the reference, it loads as one
    again = mexc.load(tmp_path / "r.mexc")
    assert type(again) is mexc.Program and again.options.target == "reference"
    back = mexc.load(tmp_path / "r.mexc", target="c")
    assert type(back) is CProgram and back.options.target == "c"
    _continues_alike(back, again)


def test_load_retargets_llvm_to_c(tmp_path: Path) -> None:
    _llvm_class()
    prog = _trained("llvm")
    prog.save(tmp_path / "p.mexc")
    c = mexc.load(tmp_path / "p.mexc", target="c")
    assert type(c) is CProgram and c.options.target == "c"
    _continues_alike(c, prog)


def _saved_as_cuda(tmp_path: Path) -> tuple[Path, mexc.Program]:
    """A checkpoint recording target cuda, as a CUDA artifact's program file or a GPU training
    run writes it (the reference program retargeted: no GPU needed to write one)."""
    prog = _trained("reference")
    path = tmp_path / "gpu.mexc"
    prog.retargeted("cuda").save(path)
    return path, prog


def test_loading_a_cuda_checkpoint_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: loading onto the GPU may work here")
    path, prog = _saved_as_cuda(tmp_path)
    with pytest.raises(mexc.CheckpointError) as err:
        mexc.load(path)
    text = str(err.value)
    assert "\n" not in text, text  # one paragraph
    assert "saved target 'cuda'" in text and "CuPy" in text, text
    assert f"mexc.load({str(path)!r}, target='reference')" in text, text
    assert "mexc.load_cuda(DIR)" in text, text
    ref = mexc.load(path, target="reference")  # what the message says works
    assert type(ref) is mexc.Program and ref.options.target == "reference"
    _continues_alike(ref, prog)


def test_loading_an_llvm_checkpoint_without_tvm_is_a_clear_error(tmp_path: Path) -> None:
    """In a fresh interpreter where TVM cannot be imported."""
    prog = _trained("reference")
    path = tmp_path / "llvm.mexc"
    prog.retargeted("llvm").save(path)
    code = (
        "import sys\n"
        "sys.modules['tvm'] = None  # importing TVM now fails\n"
        "import mexc\n"
        "try:\n"
        f"    mexc.load({str(path)!r})\n"
        "except mexc.CheckpointError as err:\n"
        "    print(err)\n"
        f"print(mexc.load({str(path)!r}, target='reference').state_checksum())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    message, checksum = run.stdout.strip().split("\n")
    assert "saved target 'llvm'" in message and "TVM" in message, message
    assert "target='reference'" in message, message
    assert checksum == prog.state_checksum()


def test_unknown_targets(tmp_path: Path) -> None:
    prog = _trained("reference", steps=0)
    path = tmp_path / "tpu.mexc"
    prog.retargeted("tpu").save(path)
    with pytest.raises(mexc.CheckpointError, match="saved from target 'tpu'.*target='reference'"):
        mexc.load(path)
    assert mexc.load(path, target="reference").state_checksum() == prog.state_checksum()
    with pytest.raises(ValueError, match="'tpu' is not available yet"):
        mexc.load(tmp_path / "tpu.mexc", target="tpu")
