#!/usr/bin/env bash
# One command for the H200 machine: install, run the GPU tests, run the benchmarks.
#
#   bash tools/gpu_run.sh [OUT]        # OUT defaults to $OUT, else ./gpu-results
#
# The machine has no network: wheels the project needs beyond what is installed there
# (onnxruntime-extensions) come from ./.whl (see docs/benchmarks/README.md for how to fetch them).
# Full results land in OUT (pytest log and JUnit XML, benchmark JSON); a short table prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-results}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export GENAI_EP_KERNEL_CACHE="${GENAI_EP_KERNEL_CACHE:-/tmp/genai-ep-kernels}"

echo "== install"
site=/tmp/genai-ep-site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
fi
# The project runs from its checkout; its other dependencies are on that machine already.
export PYTHONPATH="$site:$PWD:$PWD/plugins:$PWD/graphs${PYTHONPATH:+:$PYTHONPATH}"
# Entry points need installed metadata: an editable install without dependencies provides it.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/pip.log" 2>&1 \
    || { echo "pip install -e failed"; tail -20 "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'EOF' | tee -a "$out/gpu.txt"
import importlib.metadata as md
for name in ("cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy",
             "onnxruntime", "onnxruntime-extensions", "onnx"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} missing")
EOF

echo "== kernels compile"
python3 -m ep.cli kernels --json >"$out/kernels.json" || { echo "kernel compile failed"; exit 1; }

echo "== GPU tests"
python3 -m pytest -q -m cuda -p no:cacheprovider --junitxml="$out/pytest-cuda.xml" tests \
    2>&1 | tee "$out/pytest-cuda.log" | tail -15
cuda_rc=${PIPESTATUS[0]}

echo "== kernel benchmark"
python3 tools/bench_kernels.py --out "$out" 2>&1 | tee "$out/bench_kernels.log" | tail -12
bench_rc=${PIPESTATUS[0]}

echo "== native executor benchmark"
python3 tools/bench_native.py --device cuda --offload scan_resistant --budget 75% --out "$out" 2>&1 | tee "$out/bench_native.log" | tail -30
native_rc=${PIPESTATUS[0]}

echo "== whole suite on the GPU machine"
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest-all.log" | tail -5
all_rc=${PIPESTATUS[0]}

echo "== summary: cuda tests rc=$cuda_rc, all tests rc=$all_rc, kernel benchmark rc=$bench_rc," \
     "native benchmark rc=$native_rc"
[ "$cuda_rc" = 0 ] && [ "$all_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$native_rc" = 0 ]
