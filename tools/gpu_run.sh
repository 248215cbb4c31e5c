#!/usr/bin/env bash
# One GPU session's work, in order, under one time budget, with everything written under OUT_DIR:
#   1. env       the versions (labkit's guards check the image's torch and Triton)
#   2. kernels   every kernel test compiled on CUDA (tests/test_kernels_*.py on the GPU, and tests/gpu/: shapes the
#                interpreter cannot afford, int64 offsets)
#   3. chapters  every chapter on CUDA under nbval-lax: errors fail, outputs are not compared with the CPU-stored
#                ones, claims are still asserted
#   4. bench     python -m labkit.bench all: the ceilings, every kernel against its baselines, the targets
# Usage: tools/gpu_run.sh OUT_DIR [--dry-run]
#   --dry-run needs no GPU: steps 2 and 3 say why they are skipped, step 4 runs on tiny shapes under Triton's
#   interpreter (tests/test_gpu_run.py runs this in `make test`, so the script cannot rot before a GPU is lent).
# It uses only the Python it is given (PYTHON, default python3) with the repository on PYTHONPATH: nothing is installed.
set -u
OUT=${1:?usage: tools/gpu_run.sh OUT_DIR [--dry-run]}
DRY_RUN=${2:-}
BUDGET_S=${GPU_RUN_BUDGET_S:-480}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }
seconds_left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME LIMIT_S COMMAND...: run COMMAND with at most LIMIT_S (and never past the budget), log to OUT/NAME.log
step() {
    local name=$1 limit=$2; shift 2
    local left; left=$(seconds_left)
    if (( left < 10 )); then note "$name: skipped: the ${BUDGET_S} s budget is spent"; FAILED=1; return; fi
    (( limit > left )) && limit=$left
    local began; began=$(date +%s)
    (cd "$ROOT" && timeout --kill-after=10 "$limit" "$@") > "$OUT/$name.log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - began ))
    case $rc in
        0) note "$name: passed in ${took} s" ;;
        124|137) note "$name: timed out after ${limit} s (see $name.log)"; FAILED=1 ;;
        *) note "$name: FAILED (exit $rc) in ${took} s (see $name.log)"; FAILED=1 ;;
    esac
}

HAS_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [[ "$DRY_RUN" != "--dry-run" && "$HAS_CUDA" != 1 ]]; then
    echo "no CUDA device here: run with --dry-run (or on a GPU machine)" >&2
    exit 2
fi
note "gpu_run: $( [[ $DRY_RUN == --dry-run ]] && echo 'dry run' || echo 'on CUDA' ), budget ${BUDGET_S} s, output in $OUT"

step env 60 "$PY" -c "import labkit, torch; print(labkit.runtime.environment_line()); print('cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"

if [[ "$HAS_CUDA" == 1 && "$DRY_RUN" != "--dry-run" ]]; then
    step kernels 150 env LABKIT_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/test_kernels_*.py tests/gpu
    if ! "$PY" -c "import nbval" 2>/dev/null && compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
        # a GPU image without Jupyter: wheels carried in .whl/ (nbval, nbformat, nbclient, ipykernel and their needs),
        # installed from disk only, into a folder of their own
        step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$OUT/site" "$ROOT"/.whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$OUT/site"
    fi
    if "$PY" -c "import nbval" 2>/dev/null; then
        step chapters 240 env LABKIT_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra --nbval-lax notebooks
    else
        note "chapters: skipped: nbval is not installed in this Python (carry its wheels and their needs in .whl/ to run them)"
    fi
    step bench 150 "$PY" -m labkit.bench all --json "$OUT/bench.json" --markdown "$OUT/benchmarks.md"
else
    note "kernels: skipped: no CUDA device (the interpreter runs these tests in make test)"
    note "chapters: skipped: no CUDA device (make test runs every chapter on the CPU)"
    step bench 150 env LABKIT_DEVICE=cpu "$PY" -m labkit.bench all --dry-run --json "$OUT/bench.json" --markdown "$OUT/benchmarks.md"
fi
note "gpu_run: $( ((FAILED)) && echo 'some steps failed' || echo 'all steps passed or were skipped with a reason' ) in $(( $(date +%s) - START )) s"
exit $FAILED
