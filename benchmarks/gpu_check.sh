#!/usr/bin/env bash
# Issue 11's one-GPU bring-up check, one command (benchmarks/gpu_check.py says what it runs and judges).
#
#   bash benchmarks/gpu_check.sh              # on a one-GPU machine: at most 8 minutes on an H200
#   bash benchmarks/gpu_check.sh --dry-run    # on CPU: the same steps at tiny sizes
#
# Uses .venv/bin/python where this checkout has one, else python3 (the GPU machine's image, whose torch
# is used as it is: nothing is installed). Wheels in .whl/ (ignored by git) are installed first, without
# an index, for packages that image lacks. The summary goes to $OUT/gpu_check.json when OUT is set (the
# device tool's output folder), else out/gpu_check/; the log beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/planner-site .whl/*.whl
    export PYTHONPATH=/tmp/planner-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
dir=${OUT:-out/gpu_check}
mkdir -p "$dir"
# On a GPU the check stays under 8 minutes: the script skips the steps left once its budget is spent and
# times out any one step; this bound is the last resort (a run killed by it writes no summary).
bound=()
[[ " $* " == *" --dry-run "* ]] || bound=(timeout 570)
"${bound[@]}" "$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$dir/gpu_check.log"
exit "${PIPESTATUS[0]}"
