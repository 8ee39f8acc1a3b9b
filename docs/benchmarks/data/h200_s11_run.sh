#!/usr/bin/env bash
# Eleventh session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s11_run.sh OUT
# The packed 4-bit GEMV's CUDA tests, then it (both compiled rings) against the 4-bit GEMVs of
# the unpacked weight on the model's large shapes, in one process (tools/bench_kernels.py).
# The norm-prologue A/B of the same session is on the branch `norm-prologue` (its copy of this
# script: modes tests and ab).
set -u
out=${1:-$OUT}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_q4p_kernels.py \
  > "$out/q4p_tests.log" 2>&1
tail -3 "$out/q4p_tests.log"
timeout 300 python3 tools/bench_kernels.py --formats q4,q4p,q4p-d8b2 \
  --shapes "${SHAPES:-896x151936,896x9728,896x4864,4864x896}" --rows 1,4,16 --no-attention \
  --no-torch --reps 20 --out "$out/k" > "$out/k.log" 2>&1
grep -E "^gemv|^device copy" "$out/k.log"
