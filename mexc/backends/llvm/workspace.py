"""What the host kernels allocate for themselves when they run: TVM's workspace.

A kernel's intermediate buffers (a padded source copy, partial maxima) are not plan buffers:
TVM's runtime allocates them per call from its workspace pool, outside the arena, and
`allocated_bytes` does not count them. This module measures them from the lowered TIR, so
that tests can hold them to a small share of the arena (a maxpool's int32 window maxima were a
quarter of FashionCNN's arena)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tvm
from tvm import tirx
from tvm.s_tir.analysis import calculate_allocated_bytes


def kernel_workspace_bytes(funcs: Mapping[str, tirx.PrimFunc], target: Any) -> dict[str, int]:
    """Bytes of global (heap) memory each kernel of `funcs` allocates per call, after TVM's
    lowering (which compacts an intermediate to the region a loop iteration touches). An
    allocation inside a parallel loop is counted once, though each thread holds its own."""
    mod = tirx.transform.BindTarget(target.with_host(target))(tvm.IRModule(dict(funcs)))
    pipeline, _, _ = tirx.get_tir_pipeline("s_tir")
    sizes = calculate_allocated_bytes(pipeline(mod))
    return {name: int(dict(scopes).get("global", 0)) for name, scopes in sizes.items()}
