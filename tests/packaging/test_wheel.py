"""The built wheel is complete: installed into a fresh virtual environment outside the repo, it
runs target="c" (the runtime C sources and headers are read from the installed package) and
exports a C project holding the runtime and board files, which builds and trains on the host.

The fresh environment borrows torch, TVM and numpy from the repo's environment through a path
line in a .pth file; such a line does not run that directory's own .pth files, so the repo's
editable install of mexc stays invisible and `import mexc` finds only the wheel's copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HAVE_CC = shutil.which("cc") is not None
HAVE_MAKE = shutil.which("make") is not None

JUNK = ("__pycache__", "*.pyc", "*.o", "*.so")


def _data_files() -> set[str]:
    """The non-Python files of the mexc package, relative to it: the tracked ones (git), or every
    one on disk when the sources are not a git checkout. All are read at run time."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "mexc"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        files = [REPO / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in (REPO / "mexc").rglob("*") if p.is_file()]
    return {
        p.relative_to(REPO / "mexc").as_posix()
        for p in files
        if p.is_file()
        and p.suffix not in (".py", ".pyc", ".o", ".so")
        and "__pycache__" not in p.parts
    }


# Runs inside the fresh environment, from a cwd outside the repo. argv: site-packages, project dir.
CHECK = textwrap.dedent(
    """\
    import sys
    from pathlib import Path

    import numpy as np
    import torch
    from torch import nn

    import mexc
    from mexc.backends.c.project import RUNTIME_DIR

    site, project = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    pkg = Path(mexc.__file__).resolve().parent
    assert pkg == site / "mexc", f"mexc imported from {pkg}, not from the wheel in {site}"
    assert RUNTIME_DIR.is_relative_to(pkg), RUNTIME_DIR

    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)
        )

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    ref = mexc.compile(model(), (torch.zeros(4, 1, 8, 8),), target="reference")
    c = mexc.compile(model(), (torch.zeros(4, 1, 8, 8),), target="c")
    start = ref.state_checksum()
    assert c.state_checksum() == start
    for k in range(2):
        ref.step(x[4 * k : 4 * k + 4], y[4 * k : 4 * k + 4])
        c.step(x[4 * k : 4 * k + 4], y[4 * k : 4 * k + 4])
    assert c.state_checksum() == ref.state_checksum() != start

    out = mexc.export(c, project, data=(x, y), steps=2, board="host")
    c.replay((x, y), 2)
    print("RUNTIME", *sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()))
    print("EXPECTED", c.state_checksum())
    """
)


def _state_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("STATE ")]
    assert lines, out[-2000:]
    return lines[-1].split()[1]


def _build_wheel(dest: Path, tmp: Path) -> Path:
    """Build from a copy of the sources, so stale build/ or egg-info folders in the checkout
    cannot add or hide files (and the checkout is not written to)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "mexc", src / "mexc", ignore=shutil.ignore_patterns(*JUNK))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    res = subprocess.run([*cmd, "-q", "-w", str(dest), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    (wheel,) = dest.glob("mexc-*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.skipif(not (HAVE_CC and HAVE_MAKE), reason="needs a host C compiler (cc) and make")
def test_wheel_installs_and_runs_c_target_outside_repo(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path / "dist", tmp_path)
    data = _data_files()
    assert {"backends/c/runtime/mexc_rt.h", "backends/cuda/emu.hpp"} <= data, data
    missing = {f"mexc/{f}" for f in data} - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"the wheel lacks {sorted(missing)}"

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    # Install first, while the repo's environment is not yet on the fresh one's path: pip then
    # sees no other mexc (it would otherwise try to replace the editable install).
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
        + ["--no-index", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert (site / "mexc" / "backends" / "c" / "runtime" / "mexc_rt.h").is_file()
    deps = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (site / "zz_mexc_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))

    work = tmp_path / "work"  # cwd outside the repo, so the checkout is not on sys.path
    work.mkdir()
    (work / "check.py").write_text(CHECK)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["MEXC_CACHE_DIR"] = str(tmp_path / "cache")  # compile the C library afresh
    res = subprocess.run(
        [str(py), "check.py", str(site), str(work / "project")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    fields = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines() if ln.strip()}
    exported = set(fields["RUNTIME"])
    want = {f.removeprefix("backends/c/") for f in data if f.startswith("backends/c/runtime/")}
    assert want <= exported, f"the exported project lacks {sorted(want - exported)}"
    generated = {"Makefile", "model.c", "model.h", "kernels.c", "kernels.h", "data.c", "data.h"}
    assert generated <= exported

    make = subprocess.run(
        ["make", "-s", "-C", str(work / "project"), "run-host"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert make.returncode == 0, make.stdout[-2000:] + make.stderr[-4000:]
    assert _state_line(make.stdout + make.stderr) == fields["EXPECTED"][0]
