#!/usr/bin/env bash
# One command for the H200 machine: install, run the GPU tests, run the benchmarks.
#
#   bash tools/gpu_run.sh [OUT]        # OUT defaults to $OUT, else ./gpu-results
#   LARGE=0 skips the 1.5B-shaped offload run; ALL=1 adds the whole test suite.
#   STAGES="tests profile" runs only those stages (compile tests profile kernels sampling native
#   large, the default; and table stack ncu-stack): a session's calls on the device machine are at
#   most 10 minutes each. TESTS="PATH ..." narrows the tests stage to those paths (default: tests).
#   table: the native issue's table (tools/bench_native.py at batch 1, 4, 16, 64 steps, 3
#   repeats; NATIVE_ARGS adds arguments); stack: tools/bench_stack.py (STACK_ARGS adds arguments,
#   e.g. --tunings 8:0:4:0 --trace); ncu-stack: Nsight Compute's warp stall reasons of one launch
#   of the persistent stack kernel, by source line (compiled with line info).
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

# Each stage has a time limit (seconds; the device time of a session is short) and writes its
# results under OUT as it goes, so a stage that runs out of time still leaves the others'.
STAGES=" ${STAGES:-compile tests profile kernels sampling native large} "
want() { [[ "$STAGES" == *" $1 "* ]]; }

if want compile; then
    echo "== kernels compile"
    python3 -m ep.cli kernels --json >"$out/kernels.json" || { echo "kernel compile failed"; exit 1; }
fi
stage() {  # stage LIMIT NAME COMMAND...
    local limit=$1 name=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -"${TAIL:-30}"
    local rc=${PIPESTATUS[0]}
    echo "$name rc=$rc" >>"$out/rc.txt"
    return "$rc"
}

cuda_rc=0 bench_rc=0 native_rc=0
if want tests; then
    # shellcheck disable=SC2086  # TESTS is a list of paths
    TAIL=15 stage 420 pytest-cuda python3 -m pytest -q -m cuda -p no:cacheprovider \
        --junitxml="$out/pytest-cuda.xml" ${TESTS:-tests}
    cuda_rc=$?
fi
if want profile; then  # batch 1 and 16, then A/Bs: no fusions, no SwiGLU / QKV-commit epilogue,
    # no early loads
    TAIL=40 stage 90 profile python3 tools/profile_native.py --batch 1,16 --out "$out"
    mkdir -p "$out/unfused" "$out/mlp-off" "$out/qkv-off" "$out/late"
    GENAI_EP_FUSE_QKV=0 TAIL=24 stage 90 profile-qkv-off python3 tools/profile_native.py \
        --batch 1,16 --out "$out/qkv-off"
    GENAI_EP_FUSE=0 TAIL=12 stage 60 profile-unfused python3 tools/profile_native.py --batch 1 \
        --loop 0 --out "$out/unfused"
    GENAI_EP_FUSE_MLP=0 TAIL=24 stage 90 profile-mlp-off python3 tools/profile_native.py \
        --batch 1,16 --out "$out/mlp-off"
    GENAI_EP_EARLY=0 TAIL=12 stage 60 profile-late python3 tools/profile_native.py --batch 1,16 \
        --out "$out/late"
fi
if want kernels; then
    TAIL=14 stage 200 bench-kernels python3 tools/bench_kernels.py --out "$out" --reps 20 --no-torch \
        --gemv v1,v2 --attention v1,v2
    bench_rc=$?
fi
if want sampling; then
    mkdir -p "$out/sampling"
    TAIL=20 stage 120 bench-sampling python3 tools/bench_sampling.py --batch 1,4,16,64 --reps 50 \
        --out "$out/sampling"
    sampling_rc=$?  # a kernel benchmark too: ids not the reference's fail it
    [ "$bench_rc" = 0 ] && bench_rc=$sampling_rc
fi
if want native; then
    TAIL=60 stage 300 bench-native python3 tools/bench_native.py --device cuda \
        --batches 1 2 4 8 16 --steps 32 --offload scan_resistant --budget 100%,75%,50%,25% \
        --out "$out"
    native_rc=$?
fi
if want table; then
    # shellcheck disable=SC2086  # NATIVE_ARGS is a list of arguments
    TAIL=40 stage 420 bench-table python3 tools/bench_native.py --device cuda --batches 1 4 16 \
        --steps 64 --repeats 3 --out "$out/table" ${NATIVE_ARGS:-}
    native_rc=$?
fi
if want stack; then
    # shellcheck disable=SC2086  # STACK_ARGS is a list of arguments
    TAIL=40 stage 300 bench-stack python3 tools/bench_stack.py --out "$out" ${STACK_ARGS:-}
    bench_rc=$?
fi
if want ncu-stack; then  # one launch (a prompt step), its stalls by source line
    cat >"$out/ncu_stack.py" <<'PY'
import sys

import ep.kernels.stack as stack
from ep.device._kernels import compiled_source

options, kernel = stack.CompileOptions, stack.stack_kernel
stack.CompileOptions = lambda **kw: options(**kw, lineinfo=True)  # source lines in the report


def with_source(*args, **kwargs):  # the source as a file where the line info points
    source = kernel(*args, **kwargs)
    with open(source.name, "w") as f:
        f.write(compiled_source(source, "sm_90a"))
    return source


stack.stack_kernel = with_source
sys.path.insert(0, "tools")
import bench_stack  # noqa: E402

raise SystemExit(bench_stack.main(["--reps", "2", "--rounds", "1", "--prompt", "8"]))
PY
    TAIL=60 stage 300 ncu-stack ncu --kernel-name regex:ep_stack_bf16 --launch-skip 4 \
        --launch-count 1 --section WarpStateStats --section SourceCounters --import-source yes \
        -o "$out/ncu-stack" -f python3 "$out/ncu_stack.py"
    ncu --import "$out/ncu-stack.ncu-rep" --page source --csv --print-source cuda \
        >"$out/ncu-stack-source.csv" 2>&1 || true
    ncu --import "$out/ncu-stack.ncu-rep" --page details --print-details all \
        >"$out/ncu-stack-details.txt" 2>&1 || true
    ncu --import "$out/ncu-stack.ncu-rep" --page raw --csv >"$out/ncu-stack-raw.csv" 2>&1 || true
    mv ep_stack_bf16_* "$out/" 2>/dev/null || true
    tail -40 "$out/ncu-stack-details.txt"
fi
if want large && [ "${LARGE:-1}" = 1 ]; then  # the 1.5B shape: does not fit a small budget
    mkdir -p "$out/large"
    TAIL=30 stage 200 bench-native-large python3 tools/bench_native.py --device cuda \
        --spec qwen2.5-1.5b --batches 1 8 --steps 16 --repeats 2 --no-hf --offload scan_resistant \
        --budget 100%,50%,25% --out "$out/large"
fi
if [ "${ALL:-0}" = 1 ]; then
    TAIL=5 stage 400 pytest-all python3 -m pytest -q -p no:cacheprovider tests
fi

echo "== summary: cuda tests rc=$cuda_rc, kernel benchmark rc=$bench_rc, native benchmark" \
     "rc=$native_rc (every stage: $out/rc.txt)"
[ "$cuda_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$native_rc" = 0 ]
