#!/usr/bin/env bash
# Sixteenth session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s16_run.sh OUT [tests] [stack]
# tests: the CUDA tests named in TESTS;
# stack: tools/bench_stack.py, the persistent decoder-stack kernel against the native executor's
#        captured decode step (ARGS: more arguments for it).
set -u
out=${1:-$OUT}
shift || true
stages=${*:-tests stack}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for stage in $stages; do
  case $stage in
  tests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda ${TESTS:-tests/kernels/test_stack.py} \
      > "$out/tests.log" 2>&1
    tail -3 "$out/tests.log" ;;
  stack)
    timeout 400 python3 tools/bench_stack.py --out "$out" ${ARGS:-} 2>&1 | tee "$out/stack.log" | grep -v "^model:" ;;
  esac
done
