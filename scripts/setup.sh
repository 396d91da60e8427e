#!/usr/bin/env bash
# Create .venv (once) and install loopprobe with the pinned dev/test environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and alone: pinned to the CPU wheel, so nothing else can pull a CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,docs,notebooks]"
# mup (for CoordCheck.to_mup's test against mup's own plot): its metadata asks for torchvision, which
# coord_check never imports and which would pull another torch; installed without its dependencies.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -c constraints.txt mup==1.0.0
