"""Lowering of mexc kernels with Apache TVM: TE definitions of the int8 products
(`te_products`), plain C99 for FPU-less MCUs (`plain_c`), host CPU modules (`tvm_llvm_products`).

TVM is imported only by the submodules, so `import mexc` stays free of it."""
