#!/usr/bin/env bash
# Tenth session's runs on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s10_run.sh OUT
# The sampling kernel's, the device layer's and the device loop's tests (CPU and CUDA), then
# tools/bench_sampling.py (model-like and flat logits) and decode with sampling in the device loop
# against greedy there and sampling on the host (h200_s10_sampling_e2e.py).
set -u
out=${1:-$OUT}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sample_kernels.py tests/device tests/native/test_native_sync.py tests/native/test_bench_sampling_tool.py > "$out/tests.log" 2>&1; tail -4 "$out/tests.log"
timeout 120 python3 tools/bench_sampling.py --batch 1,4,16,64 --reps 50 --out "$out/s" > "$out/s.log" 2>&1; cat "$out/s.log"
timeout 60 python3 tools/bench_sampling.py --batch 1,16 --settings t0.8-p0.9,t1.0 --flat --reps 30 --out "$out/flat" > "$out/flat.log" 2>&1; cat "$out/flat.log"
timeout 200 python3 docs/benchmarks/data/h200_s10_sampling_e2e.py > "$out/e2e.log" 2>&1; tail -12 "$out/e2e.log"
