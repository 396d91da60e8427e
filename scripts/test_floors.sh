#!/usr/bin/env bash
# The declared lower bounds of numpy, pandas and scipy, tested: installs those versions into a
# folder that shadows .venv's (pip install --target, PYTHONPATH first) and runs the core test
# files against them with .venv's torch. torch's own floor is the pinned 2.13 (the only torch
# the tests run on; older wheels are multi-GB CUDA builds). Usage: bash scripts/test_floors.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FLOORS=$(mktemp -d)
trap 'rm -rf "$FLOORS"' EXIT
# keep these equal to pyproject.toml's floors (tests/test_package_metadata.py checks it)
.venv/bin/pip install -q --no-deps --target "$FLOORS" \
    "numpy==1.26.4" "pandas==2.0.3" "scipy==1.12.0" pytz tzdata
PYTHONPATH="$FLOORS" .venv/bin/python -m pytest -q -n 0 -p no:cacheprovider \
    tests/test_alignment.py tests/test_linalg.py tests/test_fixedpoint.py \
    tests/test_increments.py tests/test_monitor.py tests/test_monitor_sinks_safe.py "$@"
