"""Load and run the offline-compiled CUDA product kernels (docs/cuda.md). Needs neither TVM nor
nvcc: the artifact folder holds the cubin and `products.json`; launching needs a GPU and CuPy.

    art = ProductArtifact.load("build/fashion-sm_90")   # validates; works without a GPU
    acc = art.run(0, [x, w])                            # product 0 on the GPU -> int32 accumulator
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mexc.errors import MexcError
from mexc.numerics import random_bits

FORMAT = "mexc-cuda-products-1"
ARCHS = ("sm_80", "sm_90")
_DTYPES = {"int8": np.int8, "int32": np.int32}


class ArtifactError(MexcError):
    """A CUDA artifact folder is missing, corrupt, or for another architecture."""


def _fail(path: Path, what: str) -> ArtifactError:
    return ArtifactError(
        f"CUDA artifact {path}: {what}. Rebuild it with mexc.codegen.cuda_build.build_products "
        "(or bench/make_gpu_artifacts.py) on a machine with TVM and nvcc."
    )


@dataclass(frozen=True)
class Launch:
    symbol: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass
class ProductArtifact:
    """The product kernels of one compiled program for one GPU architecture."""

    path: Path
    arch: str
    cubin_path: Path
    products: list[dict[str, Any]]
    kernel_sets: dict[str, list[Launch]]
    _mod: Any = None

    @staticmethod
    def load(path: str | Path) -> ProductArtifact:
        root = Path(path)
        try:
            man = json.loads((root / "products.json").read_text())
        except FileNotFoundError:
            raise _fail(root, "products.json is missing") from None
        except json.JSONDecodeError as exc:
            raise _fail(root, f"products.json is not valid JSON ({exc})") from None
        if man.get("format") != FORMAT:
            raise _fail(root, f"format is {man.get('format')!r}, expected {FORMAT!r}")
        if man.get("arch") not in ARCHS:
            raise _fail(root, f"arch {man.get('arch')!r} is not one of {ARCHS}")
        cubin_path = root / str(man.get("cubin"))
        if not cubin_path.is_file():
            raise _fail(root, f"the cubin {cubin_path.name} is missing")
        cubin = cubin_path.read_bytes()
        if hashlib.sha256(cubin).hexdigest() != man.get("cubin_sha256"):
            raise _fail(root, f"{cubin_path.name} does not match its SHA-256 in products.json")
        sets = {name: [_launch(root, k) for k in ks] for name, ks in man["kernel_sets"].items()}
        for i, prod in enumerate(man["products"]):
            if prod.get("kernels") not in sets:
                raise _fail(root, f"product {i} names an unknown kernel set {prod.get('kernels')}")
        return ProductArtifact(root, man["arch"], cubin_path, man["products"], sets)

    def operand_specs(self, index: int) -> dict[str, tuple[int, ...]]:
        """{operand name: shape} of product `index` (int8 arrays, C order)."""
        return {n: tuple(o["shape"]) for n, o in self.products[index]["operands"].items()}

    def run(self, index: int, operands: dict[str, np.ndarray]) -> np.ndarray:
        """Run product `index` on the GPU (CuPy); returns the int32 accumulator."""
        cp = _cupy()
        launches = self.kernel_sets[self.products[index]["kernels"]]
        module = self._module(cp)
        buffers: dict[str, Any] = {}
        for name, shape in self.operand_specs(index).items():
            arr = np.ascontiguousarray(operands[name])
            if arr.dtype != np.int8 or arr.shape != shape:
                raise ValueError(
                    f"operand {name} must be int8 {shape}, got {arr.dtype} {arr.shape}"
                )
            buffers[name] = cp.asarray(arr)
        for launch in launches:
            for name, shape, dtype in launch.args:
                if name not in buffers:
                    buffers[name] = cp.zeros(shape, dtype=_DTYPES[dtype])
            fn = module.get_function(launch.symbol)
            fn(launch.grid, launch.block, tuple(buffers[name] for name, _, _ in launch.args))
        cp.cuda.Device().synchronize()
        return np.asarray(cp.asnumpy(buffers["acc"]))  # the unpack kernel's output

    def _module(self, cp: Any) -> Any:
        if self._mod is None:
            self._mod = cp.RawModule(path=str(self.cubin_path))  # verified by SHA-256 at load
        return self._mod


def _launch(root: Path, k: dict[str, Any]) -> Launch:
    try:
        args = tuple((a["name"], tuple(a["shape"]), a["dtype"]) for a in k["args"])
        if any(dtype not in _DTYPES for _, _, dtype in args):
            raise KeyError("dtype")
        return Launch(k["symbol"], tuple(k["grid"]), tuple(k["block"]), args)
    except (KeyError, TypeError) as exc:
        raise _fail(root, f"a kernel launch entry is malformed ({exc})") from None


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise MexcError(
            "running CUDA kernels needs CuPy and an NVIDIA GPU (pip install cupy-cuda12x or "
            "cupy-cuda13x); loading and validating an artifact does not."
        ) from None
    return cupy


def deterministic_operands(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Deterministic int8 operands from the reference PRNG (same bytes on every machine)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        n = int(np.prod(shape, dtype=np.int64))
        words = random_bits(seed * 16 + i, np.arange(n, dtype=np.uint32))
        out[name] = ((words & 0xFF).astype(np.int16) - 128).astype(np.int8).reshape(shape)
    return out


def digest(acc: np.ndarray) -> str:
    """SHA-256 of an int32 accumulator's little-endian bytes."""
    return hashlib.sha256(np.ascontiguousarray(acc, dtype="<i4").tobytes()).hexdigest()
