"""The run side imports neither TVM nor torch (and so not torch.fx: `import torch` imports it).

In a fresh interpreter: load a saved checkpoint onto the reference (`mexc.load(...,
target="reference")`) and train a step; load a CUDA artifact's manifest, cubins and program
(`StepArtifact.load`) and train a step of its program on the reference. Afterwards none of
tvm, torch, torch.fx and networkx is in sys.modules. The checkpoint and the artifact are made
here, in the test process, which has the compile side (the artifact needs TVM and nvcc).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mexc
from tests.compiler.helpers import EXAMPLES

ROOT = Path(__file__).resolve().parents[2]
BATCH = 4
COMPILE_SIDE = ("tvm", "torch", "torch.fx", "networkx")

RUN = """
import json, sys
import numpy as np
import mexc

def batch(prog):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((prog.batch, *prog.input_shape)).astype(np.float32)
    return x, rng.integers(0, prog.num_classes, prog.batch)

out = {}
prog = mexc.load(sys.argv[1], target="reference")
prog.step(*batch(prog))
out["checkpoint"] = [type(prog).__name__, prog.step_count, prog.state_checksum()]
if len(sys.argv) > 2:
    from mexc.backends.cuda.program import StepArtifact

    art = StepArtifact.load(sys.argv[2])
    art.program.step(*batch(art.program))
    out["artifact"] = [list(art.archs), art.program.step_count, art.program.state_checksum()]
out["imported"] = [m for m in COMPILE_SIDE if m in sys.modules]
print(json.dumps(out))
"""


def _program() -> mexc.Program:
    cls, shape = EXAMPLES["MLP"]
    torch.manual_seed(0)
    return mexc.compile(cls(), (torch.zeros(BATCH, *shape),))


def _stepped(prog: mexc.Program) -> tuple[int, str]:
    """Step count and state checksum after the step the child trains."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((prog.batch, *prog.input_shape)).astype(np.float32)
    prog.step(x, rng.integers(0, prog.num_classes, prog.batch))
    return prog.step_count, prog.state_checksum()


def _run_side(*paths: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", f"COMPILE_SIDE = {COMPILE_SIDE!r}\n{RUN}", *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _checkpoint(tmp_path: Path) -> tuple[Path, list]:
    prog = _program()
    _stepped(prog)
    path = tmp_path / "run.mexc"
    prog.save(path)
    return path, ["Program", *_stepped(prog)]


def test_loading_and_stepping_a_checkpoint_imports_no_compile_side(tmp_path: Path) -> None:
    path, want = _checkpoint(tmp_path)
    got = _run_side(path)
    assert got["checkpoint"] == want
    assert got["imported"] == []


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("tvm") is None or shutil.which("nvcc") is None,
    reason="building a CUDA artifact needs TVM and nvcc",
)
def test_loading_a_cuda_artifact_imports_no_compile_side(tmp_path: Path) -> None:
    from mexc.backends.cuda.build import build_step

    path, want = _checkpoint(tmp_path)
    prog = _program()
    build_step(prog, ("sm_80",), tmp_path / "artifact")  # about 5 s: TVM, then nvcc
    got = _run_side(path, tmp_path / "artifact")
    assert got["checkpoint"] == want
    assert got["artifact"] == [["sm_80"], *_stepped(prog)]
    assert got["imported"] == []
