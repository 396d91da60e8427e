#!/usr/bin/env bash
# Create .venv (once) and install loopprobe with the pinned dev/test environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Headless Chromium: the tests render the HTML report and the docs site as a reader sees them.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium is missing and this is not root: install it (apt-get install chromium)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and alone: pinned to the CPU wheel, so nothing else can pull a CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,docs,notebooks]"
# mup (for CoordCheck.to_mup's test against mup's own plot): its metadata asks for torchvision, which
# coord_check never imports and which would pull another torch; installed without its dependencies.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -c constraints.txt mup==1.0.0
