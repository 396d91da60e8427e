#!/usr/bin/env bash
# Set up .venv and run loopprobe's main job on its built-in default.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/loopprobe report "$@"
