#!/usr/bin/env bash
# Seventeenth session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s17_run.sh OUT [tests] [stack] [native]
# tests:  the CUDA tests named in TESTS (default: the stack kernel's and the fused decode step's);
# stack:  tools/bench_stack.py, the persistent decoder-stack kernel against the native executor's
#         captured decode step (ARGS: more arguments for it, e.g. --tunings);
# native: tools/bench_native.py, the table (native capture, loop, fused, fused loop, eager
#         and HF transformers at batch 1, 4, 16; NATIVE_ARGS: more arguments).
set -u
out=${1:-$OUT}
shift || true
stages=${*:-tests stack native}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
# the plugins' entry points (the CLI tests load them as a user's install does)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for stage in $stages; do
  case $stage in
  tests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda \
      ${TESTS:-tests/kernels/test_stack.py tests/native/test_native_stack.py} > "$out/tests.log" 2>&1
    tail -3 "$out/tests.log" ;;
  stack)
    timeout 300 python3 tools/bench_stack.py --out "$out" ${ARGS:-} 2>&1 | tee "$out/stack.log" | grep -v "^model:" ;;
  native)
    timeout 420 python3 tools/bench_native.py --device cuda --batches 1 4 16 --steps 64 --repeats 3 \
      --out "$out/n" ${NATIVE_ARGS:-} > "$out/native.log" 2>&1; tail -30 "$out/native.log" ;;
  esac
done
