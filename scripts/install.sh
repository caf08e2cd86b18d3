#!/usr/bin/env bash
# Create .venv and install planner with CPU torch 2.13.0 (pip takes that wheel from local disk; a looser
# pin would pull a multi-GB CUDA build). Sourced by scripts/test.sh and scripts/tune.sh.
#   . scripts/install.sh [extras]     e.g. ". scripts/install.sh test"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "torch==2.13.0" -e ".${1:+[$1]}"
