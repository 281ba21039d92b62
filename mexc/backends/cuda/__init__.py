"""target="cuda": integer-only tensor-core kernels built ahead of time by TVM and nvcc (`build`,
compile side), run by CuPy (`program`, `runtime`: no TVM) or emulated on the CPU (`emulator`)."""
