#!/usr/bin/env bash
# Set up .venv and run the whole test suite: tests/, proofs_check/ and the notebooks.
# Two pytest workers (pytest-xdist), one torch thread each, a test file per worker at a time;
# LOOPPROBE_TEST_WORKERS=0 runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${LOOPPROBE_TEST_WORKERS:-2}" --dist loadfile "$@"
