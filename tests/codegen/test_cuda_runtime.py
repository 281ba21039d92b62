"""The CUDA artifact of the product kernels: written with TVM + nvcc, loaded and validated without
TVM; corrupt artifacts give clear errors; the GPU check runs where a GPU and CuPy exist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cuda_products import needs_cuda_tools

import mexc
from examples.models import MLP
from mexc.cuda_runtime import ArtifactError, ProductArtifact, deterministic_operands
from mexc.errors import MexcError
from mexc.numerics import element_bits

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("MEXC_REQUIRE_CUDA_TOOLS") != "1":
        from tests.codegen.test_cuda_products import HAVE_TOOLS

        if not HAVE_TOOLS:
            pytest.skip("nvcc / cuobjdump / nvdisasm not installed")
    from mexc.codegen.cuda_build import build_products, write_expected

    torch.manual_seed(0)
    prog = mexc.compile(MLP(), (torch.zeros(16, 1, 8, 8),))
    out = tmp_path_factory.mktemp("mlp-sm_90")
    build_products(prog, "sm_90", out)
    write_expected(prog, out)
    return out


@needs_cuda_tools
def test_artifact_loads_without_tvm(artifact: Path) -> None:
    code = (
        "import sys; sys.modules['tvm'] = None\n"  # any import of tvm now fails
        "from mexc.cuda_runtime import ProductArtifact\n"
        f"art = ProductArtifact.load({str(artifact)!r})\n"
        "print(art.arch, len(art.products), sorted(art.operand_specs(0)))\n"
        "assert 'torch' not in sys.modules and 'networkx' not in sys.modules\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[:2] == ["sm_90", "8"]


@needs_cuda_tools
def test_expected_digests_cover_every_kernel_set(artifact: Path) -> None:
    art = ProductArtifact.load(artifact)
    expected = json.loads((artifact / "expected.json").read_text())["kernel_sets"]
    assert set(expected) == set(art.kernel_sets)
    for exp in expected.values():
        assert len(exp["sha256"]) == 64 and exp["macs"] > 0


@needs_cuda_tools
def test_corrupt_artifacts_are_refused(artifact: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    cubin = next(bad.glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="SHA-256"):
        ProductArtifact.load(bad)
    man = json.loads((artifact / "products.json").read_text())
    man["arch"] = "sm_75"
    (bad / "products.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="sm_75"):
        ProductArtifact.load(bad)
    (bad / "products.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        ProductArtifact.load(bad)
    with pytest.raises(ArtifactError, match="missing"):
        ProductArtifact.load(tmp_path / "nowhere")


def test_test_operands_come_from_the_reference_prng() -> None:
    ops = deterministic_operands({"x": (3, 5), "w": (4, 5)}, seed=7)
    # names in sorted order get streams 16*seed + 0, 1, ...: "w" first, then "x"
    for i, name in enumerate(("w", "x")):
        words = element_bits(7 * 16 + i, ops[name].shape)
        np.testing.assert_array_equal(ops[name], (words & 0xFF).astype(np.int16) - 128)
    big = deterministic_operands({"a": (4096,)}, seed=0)["a"]
    assert big.min() == -128 and big.max() == 127


def _have_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
        return False


@needs_cuda_tools
def test_run_without_cupy_is_a_clear_error(artifact: Path) -> None:
    if _have_gpu():
        pytest.skip("CuPy and a GPU are present")
    art = ProductArtifact.load(artifact)
    ops = deterministic_operands(art.operand_specs(0), 0)
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(MexcError, match="CuPy"):
            art.run(0, ops)


@pytest.mark.gpu
@needs_cuda_tools
def test_gpu_products_bit_exact(artifact: Path) -> None:
    if not _have_gpu():
        pytest.skip("needs CuPy and an NVIDIA GPU")
    from mexc.cuda_check import check

    rows = check(artifact)
    assert rows and all(r["exact"] for r in rows), rows
