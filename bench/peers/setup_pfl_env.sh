#!/usr/bin/env bash
# Creates the pfl-research peer environment for binaries.benchmark:
#   bench/peers/.venv-pfl with pfl 0.6.0 (pfl-research) and torch==2.13.0 (CPU).
#
# Usage: bench/peers/setup_pfl_env.sh [VENV_DIR]
#   PYTHON=/path/to/python3.11 overrides the interpreter (default: python3.11,
#   else /root/.pyenv/versions/3.11.7/bin/python).
#   WHEELS=/dir overrides the local wheel directory (default /opt/wheels, which
#   holds torch-2.13.0+cpu); it is passed as --find-links when it exists.
# Then: binaries.benchmark --peer_python=bench/peers/.venv-pfl/bin/python
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-${HERE}/.venv-pfl}"
WHEELS="${WHEELS:-/opt/wheels}"

if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then
    PYTHON="$(command -v python3.11)"
  else
    PYTHON=/root/.pyenv/versions/3.11.7/bin/python
  fi
fi
if ! "${PYTHON}" -c \
    'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "error: ${PYTHON} is not Python 3.11 (the lock and wheels are cp311)" >&2
  exit 1
fi

FIND_LINKS=()
if [[ -d "${WHEELS}" ]]; then
  FIND_LINKS=(--find-links "${WHEELS}")
fi

"${PYTHON}" -m venv "${VENV}"
# A full lock: --no-deps installs exactly these versions and nothing else.
"${VENV}/bin/python" -m pip install --no-deps "${FIND_LINKS[@]}" \
  -r "${HERE}/requirements-pfl.txt"
"${VENV}/bin/python" -m pip check
"${VENV}/bin/python" - <<'EOF'
import pfl
import torch
if pfl.__version__ != '0.6.0':
  raise SystemExit(f'expected pfl 0.6.0, got {pfl.__version__}')
if torch.__version__.split('+')[0] != '2.13.0':
  raise SystemExit(f'expected torch 2.13.0, got {torch.__version__}')
if torch.cuda.is_available() or torch.version.cuda is not None:
  print(f'warning: torch {torch.__version__} is a CUDA build; the benchmark '
        'expects the CPU build (2.13.0+cpu)')
print(f'pfl {pfl.__version__}, torch {torch.__version__}, '
      f'{torch.get_num_threads()} threads')
EOF
echo "peer python: ${VENV}/bin/python"
