#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv, from the
# pinned lock files. Safe to source or run repeatedly: it only installs when the
# lock files changed since the last successful install.
#
#   bash scripts/setup_env.sh        # set up, print the python to use
#
# Needs only Python 3.11 on the PATH (or PYTHON=/path/to/python3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TFF_PERSONAL_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "setup_env: Python 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
# espeak-ng (a system package) synthesises the speech_preference task's data
# (binaries/make_speech_data.py). Installed only when missing and we are root
# with apt-get; otherwise we say how. Never fails the setup.
if ! command -v espeak-ng >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup_env: installing espeak-ng (for the speech_preference task) ..." >&2
    { apt-get install -y -q --no-install-recommends espeak-ng >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends espeak-ng >&2; }; } \
      || echo "setup_env: warning: could not install espeak-ng; the speech_preference task needs it" >&2
  else
    echo "setup_env: note: espeak-ng is missing; the speech_preference task needs it: sudo apt-get install -y --no-install-recommends espeak-ng" >&2
  fi
fi
STAMP="$VENV/.tff_personal_lock"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
echo "setup_env: installing the pinned environment into $VENV (about 2 minutes) ..." >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip==23.2.1" >&2 || true
# --no-deps: requirements.txt is a complete lock; see its header for why TFF
# cannot go through pip's resolver.
"$VENV/bin/python" -m pip install -q --no-deps -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt" >&2
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >&2 \
  || "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
# The only mismatches allowed are TFF's jax/jaxlib pins (documented in requirements.txt).
UNEXPECTED="$("$VENV/bin/python" -m pip check 2>/dev/null \
  | grep -v -E "^(tensorflow-federated 0.87.0 has requirement jax(lib)?==0.4.14|No broken requirements)" || true)"
if [ -n "$UNEXPECTED" ]; then
  echo "$UNEXPECTED" >&2
  echo "setup_env: pip check found unexpected conflicts (above)" >&2
  exit 1
fi
echo "$WANT" > "$STAMP"
echo "setup_env: ready ($VENV)" >&2
