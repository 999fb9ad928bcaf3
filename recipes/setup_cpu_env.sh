#!/usr/bin/env bash
# Create/refresh ./.venv with the CPU build of torch and ringft. Sourced with one argument:
#   source recipes/setup_cpu_env.sh base   # ringft and its dependencies (recipes/demo_cpu.sh)
#   source recipes/setup_cpu_env.sh dev    # + the test extra: pytest, ruff, DeepSpeed, TRL, ... (tests/run.sh)
# torch comes first, from PyTorch's CPU wheel index: on Linux x86-64 the default index resolves even a
# pinned torch to the CUDA build and its nvidia-* wheels (several GB). Where that index cannot be
# reached, the default index is used (quickly: no retries). Re-runs are quick (a stamp file records
# what was installed, and for which extra).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RINGFT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRA="${1:-}"
TORCH="torch==2.13.0"
TORCH_CPU_INDEX="${RINGFT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
case "$EXTRA" in
  base | dev) ;;
  *) echo "setup_cpu_env.sh: error: give 'base' (ringft) or 'dev' (ringft + test tools), got '$EXTRA'" >&2
     return 2 2>/dev/null || exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  # setup.cfg's python_requires: transformers 5.24 / trl 1.16 publish no wheel for older Pythons
  if ! "$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; then
    echo "setup_cpu_env.sh: error: $PY is not Python 3.11+ ($("$PY" -V 2>&1 || true)), which" \
      "transformers 5.24 needs: set PYTHON=/path/to/python3.11 (or newer)" >&2
    return 2 2>/dev/null || exit 2
  fi
  if ! "$PY" -c "import ensurepip, venv" 2>/dev/null; then
    echo "setup_cpu_env.sh: error: $PY has no venv/ensurepip module: install it (Debian/Ubuntu:" \
      "sudo apt-get install python3-venv) or set PYTHON=/path/to/python3.11+" >&2
    return 2 2>/dev/null || exit 2
  fi
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.ringft-installed"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha1sum | cut -d' ' -f1)"
read -r HAVE HAVE_EXTRA 2>/dev/null < "$STAMP" || HAVE="" HAVE_EXTRA=""
# a dev install covers base; a stamp without an extra (older scripts) was a dev install
if [ "$HAVE" != "$WANT" ] || { [ "$EXTRA" = dev ] && [ "${HAVE_EXTRA:-dev}" != dev ]; }; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! "$VENV/bin/python" -m pip install -q "$TORCH" --index-url "$TORCH_CPU_INDEX" --timeout 10 --retries 0
  then
    echo "setup_cpu_env.sh: $TORCH_CPU_INDEX not reachable: $TORCH from the default index" \
      "(on Linux x86-64 PyPI serves the CUDA build)" >&2
    "$VENV/bin/python" -m pip install -q "$TORCH"
  fi
  if [ "$EXTRA" = dev ]; then
    "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
  else
    "$VENV/bin/python" -m pip install -q -e "$ROOT"
  fi
  "$VENV/bin/python" -c "import torch; b = f'CUDA {torch.version.cuda}' if torch.version.cuda else 'CPU'; \
print(f'setup_cpu_env.sh: installed torch {torch.__version__} ({b} build) and ringft ($EXTRA) in $VENV')"
  echo "$WANT $EXTRA" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
