#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite.
#   bash scripts/run_tests.sh [pytest args]
# Tests run in TEST_WORKERS pytest-xdist processes (default: one per core
# plus one, since a test waits on its subprocesses, TFF's worker and the
# disk part of the time; 0 runs them in this process), a test file per
# worker at a time, so that a module's fixtures are built once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
WORKERS="${TEST_WORKERS:-$(( $(nproc) + 1 ))}"
PARALLEL=()
if [ "$WORKERS" != 0 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi
exec .venv/bin/python -m pytest tests -q -W ignore::DeprecationWarning --durations=60 \
  "${PARALLEL[@]}" "$@"
