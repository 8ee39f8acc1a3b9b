#!/usr/bin/env bash
# Tenth session, fourth run on the H200 (from the repository root; OUT a results folder), in two
# device calls: `bash docs/benchmarks/data/h200_s10_run4.sh OUT tests`, then `... OUT bench`.
# tests: every CUDA test (the eager calls now replay their recorded launches everywhere);
# bench: where an eager prefill's host time goes, the table (bench_native.py, native eager
# included), and decode with sampling in the device loop.
set -u
out=${1:-$OUT}
what=${2:-tests}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
if [ "$what" = tests ]; then
  timeout 520 python3 -m pytest -q -p no:cacheprovider -m cuda tests > "$out/tests_cuda.log" 2>&1; tail -4 "$out/tests_cuda.log"
else
  timeout 90 python3 docs/benchmarks/data/h200_s10_prefill_profile.py > "$out/prefill.log" 2>&1; head -2 "$out/prefill.log"; tail -1 "$out/prefill.log"
  GENAI_EP_REPLAY=0 timeout 60 python3 docs/benchmarks/data/h200_s10_prefill_profile.py > "$out/prefill_noreplay.log" 2>&1; head -2 "$out/prefill_noreplay.log"
  timeout 260 python3 tools/bench_native.py --device cuda --batches 1 4 16 --steps 64 --repeats 3 --out "$out/n" > "$out/n.log" 2>&1; tail -22 "$out/n.log"
fi
