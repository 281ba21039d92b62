"""target="llvm": the training step compiled by TVM for the host CPU (docs/cpu.md)."""
