#!/usr/bin/env bash
# Set up .venv and run the whole test suite: tests/, proofs_check/ and the notebooks.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
