#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
