#!/usr/bin/env bash
# Create/refresh ./.venv with the CPU build of torch and ringft (+dev extra). Sourced by
# recipes/demo_cpu.sh and tests/run.sh. The torch pin comes first: an unpinned torch would pull a
# multi-GB CUDA build. Re-runs are quick (a stamp file records what was installed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RINGFT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
STAMP="$VENV/.ringft-installed"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha1sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
