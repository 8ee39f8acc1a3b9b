#!/usr/bin/env bash
# A/B on the device machine in one run: the working tree's files against older copies of them.
#
#   bash tools/gpu_ab.sh OLD_DIR OUT ROUNDS COMMAND...
#
# OLD_DIR mirrors the repository's paths (e.g. ab_old/ep/kernels/matmul.py, made with `git show
# REV:path`; an ignored folder carried to the machine). Each round runs COMMAND on the working
# tree ("new"), then with OLD_DIR's files swapped in ("old"), then puts the new files back; the
# string {out} in COMMAND becomes OUT/<new|old><round>. Interleaved rounds show the spread of
# each side. A failing command does not stop the rounds; the script then exits 1. Run after
# tools/gpu_run.sh (its install; its PYTHONPATH is repeated here).
set -uo pipefail
cd "$(dirname "$0")/.."
old=$1 out=$2 rounds=$3
shift 3
site=/tmp/genai-ep-site
export PYTHONPATH="$site:$PWD:$PWD/plugins:$PWD/graphs${PYTHONPATH:+:$PYTHONPATH}"
export GENAI_EP_KERNEL_CACHE="${GENAI_EP_KERNEL_CACHE:-/tmp/genai-ep-kernels}"
mapfile -t files < <(cd "$old" && find . -type f | sed 's|^\./||')
keep=$(mktemp -d)
for f in "${files[@]}"; do mkdir -p "$keep/$(dirname "$f")" && cp "$f" "$keep/$f"; done
restore() { for f in "${files[@]}"; do cp "$keep/$f" "$f"; done; }
trap restore EXIT
failed=0
for r in $(seq 1 "$rounds"); do
    for side in new old; do
        if [ "$side" = old ]; then
            for f in "${files[@]}"; do cp "$old/$f" "$f"; done
        else
            restore
        fi
        dest="$out/$side$r"
        mkdir -p "$dest"
        echo "== $side, round $r: ${*//\{out\}/$dest}"
        "${@//\{out\}/$dest}" || failed=1
    done
done
exit "$failed"
