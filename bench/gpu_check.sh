#!/usr/bin/env bash
# GPU check of the CUDA product kernels, for a machine with a GPU, CuPy and numpy (no TVM, no nvcc).
# Prepare on a build machine first:  python bench/make_gpu_artifacts.py --arch sm_90
# then carry build/gpu along and run:  bash bench/gpu_check.sh [build/gpu]
# Exits non-zero if any kernel set's accumulator differs from the host reference; writes
# cuda_check.json to $OUT when set. Well under a minute on one GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-build/gpu}"
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader || true
python3 -c 'import cupy; print("cupy", cupy.__version__)'
shopt -s nullglob
folders=("$DIR"/*/)
if ((${#folders[@]} == 0)); then
    echo "no artifacts under $DIR: run python bench/make_gpu_artifacts.py first" >&2
    exit 2
fi
python3 -m mexc.cuda_check "${folders[@]}"
