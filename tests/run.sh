#!/usr/bin/env bash
# README's test command: installs into ./.venv (CPU torch pin first), lints, runs the suite, then
# runs the numerics-sensitive tests (marker `numerics`) a second time with the math libraries held
# to another instruction set, which changes the float reduction order on any x86 CPU: tolerances
# must come from the numerics, not from one machine. Arguments go to both pytest runs; set
# RINGFT_NUMERICS2=0 to skip the second pass.
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/setup_cpu_env.sh
ruff check ringft tests benchmarks data_prep
python -m pytest -q tests "$@"
if [ "${RINGFT_NUMERICS2:-1}" != "0" ]; then
  echo "--- numerics tests again under MKL SSE4_2 / oneDNN SSE41 / ATen default kernels ---"
  # The three slowest (~4 min on 2 cores) run once here to keep CI near 10 minutes; their
  # tolerances were checked under this configuration too (benchmarks/RESULTS.md, "Test suite").
  # RINGFT_NUMERICS2=all runs every numerics test in this pass.
  SLOW='test_zero3_matches_one_process_and_resumes or test_zero3_cpu_offload_matches_one_process or test_eval_lines_cp2_matches_one_process_generate'
  if [ "${RINGFT_NUMERICS2:-1}" = "all" ]; then SELECT=(); else SELECT=(-k "not ($SLOW)"); fi
  MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default \
    python -m pytest -q -m numerics "${SELECT[@]}" tests "$@"
fi
