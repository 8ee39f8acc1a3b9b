#!/usr/bin/env bash
# Twelfth session on the H200 (from the repository root; OUT a results folder):
#   bash docs/benchmarks/data/h200_s12_run.sh OUT tests   # CUDA tests (TESTS: the paths)
#   bash docs/benchmarks/data/h200_s12_run.sh OUT ab      # decode step, A/B of $AB=1 / 0, 2 rounds
#   bash docs/benchmarks/data/h200_s12_run.sh OUT kernels # tools/bench_kernels.py: $FORMATS on $SHAPES
# The A/B is tools/profile_native.py (device time of the captured decode graph and of the device
# token loop) with the switch $AB (default GENAI_EP_STAGE: dense weights staged in shared memory)
# set to 1 and to 0, interleaved.
set -u
out=${1:-$OUT}
mode=${2:-tests}
ab=${AB:-GENAI_EP_STAGE}
mkdir -p "$out"
export PYTHONPATH=/tmp/genai-ep-site:$PWD:$PWD/plugins:$PWD/graphs GENAI_EP_KERNEL_CACHE=/tmp/genai-ep-kernels PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/genai-ep-site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$mode" = tests ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m cuda ${TESTS:-tests/kernels/test_matmul_staged.py} \
    > "$out/tests.log" 2>&1
  tail -5 "$out/tests.log"
elif [ "$mode" = kernels ]; then
  timeout 300 python3 tools/bench_kernels.py --formats ${FORMATS:-q4,q4p} --shapes ${SHAPES:-896x151936} \
    --rows 1,4,16 --no-attention --no-torch --reps 20 --out "$out/k" > "$out/k.log" 2>&1
  grep -E "^gemv|^device copy" "$out/k.log"
else
  for r in ${ROUNDS:-1 2}; do for v in 1 0; do
    env "$ab=$v" timeout 240 python3 tools/profile_native.py --batch ${BATCH:-1,4,16} --reps 100 \
      --loop 32 --out "$out/$ab$v-$r" > "$out/$ab$v-$r.log" 2>&1
    echo "$ab=$v round $r"; grep -E "^batch" "$out/$ab$v-$r.log"
  done; done
fi
