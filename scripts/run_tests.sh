#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite.
#   bash scripts/run_tests.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec .venv/bin/python -m pytest tests -q -W ignore::DeprecationWarning --durations=10 "$@"
