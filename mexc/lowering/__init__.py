"""The shared TIR lowering: every op of a training step as TE/TIR kernels over named buffers
(`step_plan.build_plan`), used by the llvm and the CUDA backends alike.

Imports TVM; nothing on the run side imports this package."""
