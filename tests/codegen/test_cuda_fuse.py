"""Runs of one-block kernels launched as one kernel (mexc.backends.cuda.fuse): which kernels
join a run, the fused kernel's buffers and barriers, the collectives' places, and the fused
source run on the CPU emulator (a body that reads another thread's result of the body before
it sees it, in either thread order)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from mexc.backends.cuda.emulator import EmulatedModule
from mexc.backends.cuda.fuse import MAX_PARAMS, fuse_one_block_runs

HEAD = (
    "#include <cstdint>\n"
    'extern "C" __global__ void __launch_bounds__(32) k0_kernel(int* x_ptr, int* y_ptr);\n\n'
)


def _kernel(name: str, params: list[str], body: str, threads: int = 32) -> str:
    args = ", ".join(f"int* __restrict__ {p}_ptr" for p in params)
    return (
        f'extern "C" __global__ void __launch_bounds__({threads}) {name}({args}) {{\n{body}\n}}\n\n'
    )


T = "((int)threadIdx.x)"
SOURCE = HEAD + "".join(
    [
        _kernel("k0_kernel", ["x", "y"], f"  y_ptr[{T}] = (x_ptr[{T}] + 1);"),
        # reads the element another thread of k0 wrote: only a barrier makes that safe
        _kernel("k1_kernel", ["y", "z"], f"  z_ptr[{T}] = y_ptr[(31 - {T})];"),
        _kernel("k2_kernel", ["z", "w"], f"  w_ptr[{T}] = (z_ptr[{T}] * 2);"),
        _kernel("k3_kernel", ["w", "x"], f"  x_ptr[{T}] = (w_ptr[{T}] - 3);"),
        _kernel("k4_kernel", ["x", "v"], f"  v_ptr[{T}] = x_ptr[{T}];"),
    ]
)


def _entry(symbol: str, buffers: list[str], grid: int = 1, threads: int = 32) -> list:
    return [0, symbol, [grid, 1, 1], [threads, 1, 1], buffers]


def test_runs_of_one_block_kernels_become_one_kernel() -> None:
    kernels = [
        _entry("k0_kernel", ["x", "y"]),
        _entry("k1_kernel", ["y", "z"]),
        _entry("k2_kernel", ["z", "w"], grid=2),  # two blocks: alone
        _entry("k3_kernel", ["w", "x"]),
        _entry("k4_kernel", ["x", "v"]),
        _entry("k0_kernel", ["v", "y"]),
        _entry("k1_kernel", ["y", "z"]),
    ]
    # a collective after the first 5 kernels: k4 and the next k0 may not share a kernel
    collectives = [[5, "all_sum", "v"], [7, "all_max", "z"]]
    out, renumbered, (source,) = fuse_one_block_runs(kernels, collectives, [SOURCE], set())
    assert [k[1] for k in out] == [
        "k0_kernel_fused0",
        "k2_kernel",
        "k3_kernel_fused1",
        "k0_kernel_fused2",
    ]
    assert out[0][4] == ["x", "y", "z"] and out[2][4] == ["w", "x", "v"]
    assert out[3][4] == ["v", "y", "z"]
    assert renumbered == [[3, "all_sum", "v"], [4, "all_max", "z"]]
    # each body once, as a device function without __restrict__; barriers between the calls
    assert (
        source.count("__device__ __forceinline__ void k0_kernel_body(int* x_ptr, int* y_ptr)") == 1
    )
    fused = source[source.index("k0_kernel_fused0(") :]
    fused = fused[: fused.index("\n}\n")]
    assert fused.count("__syncthreads();") == 1 and "k1_kernel_body(p1, p2);" in fused

    # the GEMMs stay alone, and so do kernels of another block shape
    kept, _, _ = fuse_one_block_runs(kernels[:2], [], [SOURCE], {"k1_kernel"})
    assert [k[1] for k in kept] == ["k0_kernel", "k1_kernel"]
    other = [kernels[0], _entry("k1_kernel", ["y", "z"], threads=64)]
    assert [k[1] for k in fuse_one_block_runs(other, [], [SOURCE], set())[0]] == [
        "k0_kernel",
        "k1_kernel",
    ]


def test_a_fused_kernel_takes_at_most_max_params_buffers() -> None:
    body = f"  b_ptr[{T}] = a_ptr[{T}];"
    source = HEAD + _kernel("k0_kernel", ["a", "b"], body)
    kernels = [_entry("k0_kernel", [f"a{i}", f"b{i}"]) for i in range(MAX_PARAMS)]
    out, _, _ = fuse_one_block_runs(kernels, [], [source], set())
    assert [len(k[4]) for k in out] == [MAX_PARAMS, MAX_PARAMS]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("reverse", [False, True])
def test_the_fused_kernel_runs_its_bodies_in_order_on_the_emulator(reverse: bool) -> None:
    kernels = [_entry("k0_kernel", ["x", "y"]), _entry("k1_kernel", ["y", "z"])]
    ((_, symbol, grid, block, buffers),), _, (source,) = fuse_one_block_runs(
        kernels, [], [SOURCE], set()
    )
    arrays = {
        "x": np.arange(32, dtype=np.int32) * 5,
        "y": np.zeros(32, np.int32),
        "z": np.zeros(32, np.int32),
    }
    EmulatedModule(source).launch(symbol, grid, block, [arrays[b] for b in buffers], reverse)
    np.testing.assert_array_equal(arrays["z"], (np.arange(32, dtype=np.int32) * 5 + 1)[::-1])
