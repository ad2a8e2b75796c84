#!/usr/bin/env bash
# ruff (pyproject.toml [tool.ruff]) and mypy ([tool.mypy]: strict on pdserve/core and pdserve/disagg)
# over the tree; exits non-zero on any finding. scripts/test.sh runs it before pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check pdserve tests scripts
"$PY" -m mypy
