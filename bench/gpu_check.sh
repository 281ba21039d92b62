#!/usr/bin/env bash
# GPU check of the ahead-of-time CUDA training steps, for a machine with a GPU, CuPy, torch and
# numpy (no TVM, no nvcc). Prepare on a build machine first:
#     python bench/make_gpu_artifacts.py            # writes build/gpu/{fashion,resnet18,resnet18-b128}
# then carry the repository with build/gpu and build/gpu-dp along and run:
#     bash bench/gpu_check.sh [build/gpu]
# Checks the Fashion CNN and ResNet-18 steps bit for bit against the host's checksums, times
# ResNet-18 at batch 128 (replaying a CUDA graph and kernel by kernel) against PyTorch FP32 eager
# and BF16 autocast, sets each kernel group's time beside the roofline estimate
# (bench/roofline.py), writes cuda_check.json to $OUT when set; exits non-zero on any mismatch.
# A few minutes on one GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-build/gpu}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
python3 -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__)'
shopt -s nullglob
folders=("$DIR"/*/)
if ((${#folders[@]} == 0)); then
    echo "no artifacts under $DIR: run python bench/make_gpu_artifacts.py first" >&2
    exit 2
fi
status=0
python3 -m mexc.backends.cuda.check "${folders[@]}" || status=$?
# two data-parallel workers with the collectives between their kernels (make_gpu_artifacts'
# <dir>-dp; bench/gpu_dp_check.py)
if [[ -f "${DIR%/}-dp/plan.json" ]]; then
    python3 bench/gpu_dp_check.py "${DIR%/}-dp" || status=$?
fi
exit $status
