#!/usr/bin/env bash
# Tenth session, third run on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s10_run3.sh OUT
# The native executor's CUDA tests, the device loop's and the sampling kernel's tests (CPU and
# CUDA), then decode with sampling in the device loop (h200_s10_sampling_e2e.py).
set -u
out=${1:-$OUT}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/native > "$out/tests_native.log" 2>&1; tail -3 "$out/tests_native.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/native/test_native_sync.py tests/kernels/test_sample_kernels.py > "$out/tests_sync.log" 2>&1; tail -3 "$out/tests_sync.log"
timeout 200 python3 docs/benchmarks/data/h200_s10_sampling_e2e.py > "$out/e2e.log" 2>&1; tail -12 "$out/e2e.log"
