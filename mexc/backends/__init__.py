"""The backends: `reference` (the numpy executor), `llvm` (TVM for the host CPU), `cuda` (TVM and
nvcc ahead of time, CuPy or the CPU emulator at run time) and `c` (plain C99 for FPU-less MCUs).

Shared by llvm and CUDA at run time: `plan_runtime` (the launch-plan program) and `plan_layout`
(the state region and arena of a compiled step). `kernel_cache` is the on-disk build cache."""
