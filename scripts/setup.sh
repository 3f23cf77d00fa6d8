#!/usr/bin/env bash
# One-command set-up on a fresh machine: a virtual environment in .venv with
# asyncfeed (editable), its test tools and the benchmark contenders.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,bench]"
