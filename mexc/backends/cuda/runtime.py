"""What the CUDA build and the CUDA runtime share without TVM: the architectures, the artifact
error, and CuPy (imported only when kernels are to run). The runtime is
mexc.backends.cuda.program."""

from __future__ import annotations

from typing import Any

from mexc.errors import MexcError

ARCHS = ("sm_80", "sm_90")


class ArtifactError(MexcError):
    """A CUDA artifact folder is missing, corrupt, or for another architecture."""


def cupy_module() -> Any:
    try:
        import cupy
    except ImportError:
        raise MexcError(
            "running CUDA kernels needs CuPy and an NVIDIA GPU (pip install cupy-cuda12x or "
            "cupy-cuda13x); loading and validating an artifact does not."
        ) from None
    return cupy
