#!/usr/bin/env bash
# Install planner, its test dependencies and the export targets into .venv (CPU torch 2.13.0), then run the
# test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install.sh test,exports
# The export tests load every export through torchtitan, DeepSpeed and megatron-core: here they fail, rather
# than skip, when one of those is missing.
export PLANNER_REQUIRE_EXPORT_CHECKS=1
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
