#!/usr/bin/env bash
# Thirteenth session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s13_run.sh OUT
# The MXFP4 GEMV on the FP8 tensor cores (ep_gemv_mx4f8_bf16, wgmma): its CUDA tests (every
# compiled ring in test_every_ring_variant_gives_the_bits_of_the_default) and the packed 4-bit
# and MXFP4 ones, then the 4-bit and MXFP4 GEMVs on the vocabulary projection in one process (tools/bench_kernels.py; mxfp4, mx4p and mx4f8 time the
# same MXFP4 bytes, each in its own layout).
set -u
out=${1:-$OUT}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_mx4f8_kernels.py \
  tests/kernels/test_mx4p_kernels.py tests/kernels/test_q4p_kernels.py > "$out/tests.log" 2>&1
tail -1 "$out/tests.log"
timeout 300 python3 tools/bench_kernels.py \
  --formats "${FORMATS:-mxfp4,mx4p,mx4f8,mx4f8-d12b2,mx4f8-d8b2,q4,q4p}" \
  --shapes "${SHAPES:-896x151936}" --rows 1,4,16 --no-attention --no-torch --reps 20 \
  --out "$out/k" > "$out/k.log" 2>&1
grep -E "^gemv|^device copy|FAILED" "$out/k.log"
