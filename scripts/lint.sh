#!/usr/bin/env bash
# ruff (pyproject.toml [tool.ruff]) and mypy ([tool.mypy]: strict on pdserve/core and pdserve/disagg)
# over the tree; exits non-zero on any finding. scripts/test.sh runs it before pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${LINT_PYTHON:-.venv/bin/python}  # the venv scripts/setup.sh made
"$PY" -m ruff check pdserve tests scripts
"$PY" -m mypy
