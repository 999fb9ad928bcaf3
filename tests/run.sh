#!/usr/bin/env bash
# README's test command: installs into ./.venv (CPU torch pin first), lints, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/setup_cpu_env.sh
ruff check ringft tests benchmarks data_prep
python -m pytest -q tests "$@"
