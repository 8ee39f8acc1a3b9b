#!/usr/bin/env bash
# Twelfth session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s12_mx4p_run.sh OUT
# The packed MXFP4 GEMV's and the packed 4-bit GEMV's CUDA tests, then both against the GEMVs of
# the unpacked weights on the vocabulary projection, in one process (tools/bench_kernels.py):
# mxfp4 and mx4p are timed against the same bytes (the packed layout's padding counted).
set -u
out=${1:-$OUT}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_mx4p_kernels.py \
  tests/kernels/test_q4p_kernels.py > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
timeout 300 python3 tools/bench_kernels.py --formats "${FORMATS:-mxfp4,mx4p,q4,q4p}" \
  --shapes "${SHAPES:-896x151936}" --rows 1,4,16 --no-attention --no-torch --reps 20 \
  --out "$out/k" > "$out/k.log" 2>&1
grep -E "^gemv|^device copy" "$out/k.log"
