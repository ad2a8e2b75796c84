#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite; exits non-zero on any failure.
#   bash scripts/test.sh            lint (scripts/lint.sh: ruff, mypy), then the whole suite
#   bash scripts/test.sh ARGS...    one pytest run with ARGS (e.g. tests/unit -k tcp)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
bash scripts/lint.sh  # any ruff or mypy finding fails the suite here, before the tests run
# The end-to-end tests leave most of a second core idle (server start-ups, deadlines, I/O), so the
# in-process tests (unit, disagg) run beside them at the lowest CPU priority: they take only what
# the e2e tests leave, and the e2e tests keep the timing they were written for.
tmp=$(mktemp -d)
nice -n 19 "${PYTEST[@]}" --basetemp="$tmp/in-process" tests/unit tests/disagg >"$tmp/in-process.log" 2>&1 &
bg=$!
trap 'kill "$bg" 2>/dev/null || true' EXIT
e2e=0
"${PYTEST[@]}" --basetemp="$tmp/e2e" tests/e2e || e2e=$?
in_process=0
wait "$bg" || in_process=$?
trap - EXIT
echo "==================== tests/unit tests/disagg ===================="
cat "$tmp/in-process.log"
rm -rf "$tmp"
echo "suite: e2e exit $e2e, unit+disagg exit $in_process"
[ "$e2e" = 0 ] && [ "$in_process" = 0 ]
