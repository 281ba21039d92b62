#!/bin/bash
# Per-sample training memory of mexc (llvm) against PyTorch FP32 on models mexc was not tuned
# for, one fresh process per measurement (child.py), appended to results.jsonl here;
# analyze.py prints the slopes between batch 16 and 128 (docs/benchmarks.md, "Memory on
# untuned models"). Usage: bench/research/memory_untuned/run.sh mnv3s resnet10t unet vit lstm mlp
set -u
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-.venv/bin/python}
for m in "$@"; do
  for b in 16 128; do
    "$python" "$here/child.py" "$m" "$b" mexc >/dev/null  # compiles (warms the kernel cache)
    for who in mexc mexc fp32 fp32; do
      "$python" "$here/child.py" "$m" "$b" "$who" | tail -1 >> "$here/results.jsonl"
    done
  done
done
"$python" "$here/analyze.py" "$here/results.jsonl"
