"""The GPU build's guards from the first GPU run (H200, 2026-12-04):

- nvcc 13.0's ptxas compiled max(m, max(v, -v)) for sm_90 into VIMNMX3 m, v, v, the negation
  lost, and the GPU took max v for max |v|: |v| is now (v ^ s) - s (te_compaction.iabs) and the
  SASS check refuses that instruction;
- TVM's reductions took their shuffle mask from `__activemask()`, which the CUDA guide does not
  promise to be the lanes that reach the shuffle (a hazard that did not show on that run): the
  build writes the mask in (cuda.source.converged_warp_masks), the emulator refuses
  `__activemask()` and fails a shuffle that reads a lane outside its mask.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from test_cuda_products import needs_cuda_tools

from mexc.backends.cuda.emulator import EmulatedModule, EmulatorError, emulator_source
from mexc.backends.cuda.nvcc import SAME_SOURCES, _normalize
from mexc.backends.cuda.source import converged_warp_masks

needs_gpp = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

REDUCTION = """extern "C" __global__ void __launch_bounds__({threads}) k(int* out_ptr) {{
  uint mask_ptr[1];
  int t0_ptr[1];
{body}
  out_ptr[((int)threadIdx.x)] = t0_ptr[0];
}}
"""
TOP = "  mask_ptr[0] = __activemask();\n  t0_ptr[0] = __shfl_down_sync(mask_ptr[0], 1, 16, 32);"


def test_the_build_writes_every_reduction_mask_in() -> None:
    source = "// preamble\n" + REDUCTION.format(threads=128, body=TOP) * 2
    fixed = converged_warp_masks(source)
    assert "__activemask" not in fixed
    assert fixed.count("  mask_ptr[0] = 0xffffffffu;\n") == 2
    assert fixed.replace("0xffffffffu", "__activemask()") == source  # nothing else changes
    plain = REDUCTION.format(threads=64, body="  t0_ptr[0] = 1;")
    assert converged_warp_masks(plain) == plain


@pytest.mark.parametrize(
    ("threads", "body", "why"),
    [
        (48, TOP, "block of 48 threads, not a multiple of 32"),
        (128, "  if (threadIdx.x < 4) {\n  " + TOP.replace("\n", "\n  ") + "\n  }", "inside a"),
        (128, "  t0_ptr[0] = __shfl_down_sync(__activemask(), 1, 16, 32);", "form the build"),
    ],
)
def test_a_mask_the_build_cannot_know_is_refused(threads: int, body: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        converged_warp_masks(REDUCTION.format(threads=threads, body=body))


def test_the_emulator_refuses_activemask() -> None:
    with pytest.raises(EmulatorError, match="__activemask"):
        emulator_source(REDUCTION.format(threads=128, body=TOP))


@needs_gpp
def test_the_emulator_fails_a_shuffle_that_reads_outside_its_mask() -> None:
    kernel = """extern "C" __global__ void __launch_bounds__(32) k{name}(int* out_ptr) {{
  out_ptr[((int)threadIdx.x)] = __shfl_down_sync({mask}, (int)threadIdx.x, 16, 32);
}}
"""
    module = EmulatedModule(
        kernel.format(name="_all", mask="0xffffffffu") + kernel.format(name="_half", mask="0xffffu")
    )
    out = np.zeros(32, np.int32)
    module.launch("k_all", (1, 1, 1), (32, 1, 1), [out])
    assert out.tolist() == [i + 16 if i < 16 else i for i in range(32)]
    with pytest.raises(EmulatorError, match="mask leaves out"):
        module.launch("k_half", (1, 1, 1), (32, 1, 1), [out])


def test_the_sass_reader_marks_a_three_input_max_with_equal_sources() -> None:
    assert _normalize("VIMNMX3", " R18, R10, R10, R17, !PT ;") == "VIMNMX3" + SAME_SOURCES
    assert _normalize("VIMNMX3.RELU", " R1, R2, R2, R3, !PT ;") == "VIMNMX3.RELU" + SAME_SOURCES
    assert _normalize("VIMNMX3", " R29, R24, 0x80000000, R15, !PT ;") == "VIMNMX3"
    assert _normalize("VIMNMX3", " R29, RZ, RZ, R15, !PT ;") == "VIMNMX3"


@needs_cuda_tools
def test_an_abs_max_reduction_keeps_its_negation_on_sm90(tmp_path: Path) -> None:
    """The kernel that went wrong on the H200 (a block's max |x|, 128 threads sharing it),
    built through the CUDA pipeline for sm_90: its SASS has no VIMNMX3 with equal sources, and
    its source no __activemask."""
    from mexc.backends.cuda.nvcc import compile_cubin, sass_opcodes
    from mexc.backends.cuda.schedule import lower_kernels, schedule_gpu
    from mexc.lowering.te_compaction import abs_max_kernel

    source, _ = lower_kernels({"amax": schedule_gpu(abs_max_kernel((64, 6272), "amax"))}, "sm_90")
    assert "__activemask" not in source and "0xffffffffu" in source
    cu = tmp_path / "amax.cu"
    cu.write_text(source)
    ops = sass_opcodes(compile_cubin(cu, "sm_90", tmp_path / "amax.cubin"))
    assert ops and not [op for k in ops.values() for op in k if op.endswith(SAME_SOURCES)]
    assert any(op.startswith("IABS") for k in ops.values() for op in k)
