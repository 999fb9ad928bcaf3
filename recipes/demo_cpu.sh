#!/usr/bin/env bash
# The CPU demo (README's first command): installs everything into ./.venv, trains a small LLaMA
# from scratch with CP = 2 (two gloo processes under `accelerate launch`) on synthetic
# line-retrieval records, saves a checkpoint, then evaluates line retrieval on the same ring
# (`--prompt-style ringft`: the wording of the records it was trained on). The context-extension
# demo (a shipped short-context base model, extended to 4x its length) is recipes/demo/context_extension.sh;
# it needs the base model that benchmarks/train_demo_base.py builds (not shipped yet).
# Extra arguments are recipe overrides, e.g. `bash recipes/demo_cpu.sh --train.max_steps 100`.
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/setup_cpu_env.sh
OUT=outputs/demo
rm -rf "$OUT"
accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \
  -m ringft train recipes/demo_cpu.yaml --checkpoint.output_dir "$OUT" "$@"
accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \
  -m ringft eval-lines --model "$OUT/final" --prompt-style ringft --lengths 160,256 --depths 0,0.5,1 --cases 4 \
  --dtype fp32 --backend torch --output "$OUT/eval-lines"
