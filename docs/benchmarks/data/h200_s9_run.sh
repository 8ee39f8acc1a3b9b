#!/usr/bin/env bash
# Ninth session's final run on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s9_run.sh OUT
# The tests of the native executor, the caches and the device layer (CPU and CUDA), then
# tools/loop_host.py and tools/bench_native.py. Wheels from ./.whl as tools/gpu_run.sh says.
set -u
out=${1:-$OUT}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/native tests/kv tests/device --junitxml="$out/tests.xml" > "$out/tests.log" 2>&1; tail -4 "$out/tests.log"
timeout 100 python3 tools/loop_host.py --batch 1,16 --out "$out/loop" > "$out/loop.log" 2>&1; tail -12 "$out/loop.log"
timeout 220 python3 tools/bench_native.py --device cuda --batches 1 4 16 --steps 64 --repeats 3 --out "$out/n" > "$out/n.log" 2>&1; tail -22 "$out/n.log"
