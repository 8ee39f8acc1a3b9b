#!/usr/bin/env bash
# Fourteenth session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s14_run.sh OUT [tests] [trace] [bench]
# tests: the FP8 MXFP4 GEMV's CUDA tests (every ring bitwise the default) and the kernel cache's;
# trace: tools/trace_mx4f8.py, where a launch of the FP8 MXFP4 GEMV spends its time (per-warpgroup
#        timestamps; the raw records as OUT/trace_<ring>_m<M>.npz);
# bench: the 4-bit and MXFP4 vocabulary GEMVs in one process (tools/bench_kernels.py).
# The experiment branches (l2-hint, f8-block-scale, f8-one-pass, f8-queue; docs/benchmarks/h200.md)
# ran the same stages with FORMATS naming their variants.
set -u
out=${1:-$OUT}
shift || true
stages=${*:-tests trace bench}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for stage in $stages; do
  case $stage in
  tests)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda \
      ${TESTS:-tests/kernels/test_mx4f8_kernels.py tests/device/test_kernel_cache.py} > "$out/tests.log" 2>&1
    tail -1 "$out/tests.log" ;;
  trace)
    for spec in ${TRACES:-1:d8b3 1:d12b2 16:d12b2}; do  # rows:ring
      timeout 90 python3 tools/trace_mx4f8.py --rows "${spec%%:*}" --ring "${spec#*:}" --launches 16 \
        --out "$out" 2>&1 |
        tee -a "$out/trace.log" | grep -v "^launch \([1-9]\|1[0-4]\):"
    done ;;
  bench)
    timeout 300 python3 tools/bench_kernels.py \
      --formats "${FORMATS:-mxfp4,mx4p,mx4f8,mx4f8-d12b2,q4,q4p}" \
      --shapes "${SHAPES:-896x151936}" --rows "${ROWS:-1,4,16}" --no-attention --no-torch --reps 20 \
      --out "$out/k" > "$out/k.log" 2>&1
    grep -E "^gemv|^device copy|FAILED" "$out/k.log" ;;
  esac
done
