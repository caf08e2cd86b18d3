#!/usr/bin/env bash
# The first command: install planner into .venv (CPU torch 2.13.0) and run the whole job once:
# profile this machine (cached in ~/.cache/planner), search, train the best plan, report measured
# against predicted. Extra arguments go to `planner tune`.
#   bash scripts/tune.sh [--nproc 4 --global-batch 16 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install.sh ""  # an explicit empty argument: a sourced script would see tune.sh's own arguments
exec planner tune "$@"
