#!/usr/bin/env bash
# The CPU demo (README's first command): context extension, end to end, on 2 CPU processes.
#   0. installs ringft and the CPU build of torch into ./.venv (recipes/setup_cpu_env.sh base);
#   1. evaluates the shipped base model (ringft/assets/demo_base, trained at L = 128 tokens by
#      recipes/demo/base_induction.yaml then recipes/demo/base.yaml) at L and 4L (prompts of 120 and
#      500 tokens, room left for the answer inside 128 and 512): it retrieves at L and fails at 4L;
#   2. extends it (recipes/demo/extend.yaml): RoPE theta 10K -> 160K, then fine-tunes at 512 tokens
#      with CP = 2 (two gloo processes under `accelerate launch`, the code path of a GPU run);
#   3. evaluates the extended model at L and 4L;
#   4. prints the before/after table and writes outputs/demo/before_after.png (both heatmaps).
# Extra arguments are overrides of the extension recipe, e.g. `bash recipes/demo_cpu.sh --train.max_steps 50`.
# DRY_RUN=1 prints the commands instead of running them (recipes/_stages.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=outputs/demo
BASE=ringft/assets/demo_base
if [[ ! -f "$BASE/model.safetensors" ]]; then
  echo "demo_cpu.sh: error: the base model $BASE is missing: restore it from git, or rebuild it with" \
    "'python recipes/demo/train_base.py' (~40 min on one core)" >&2
  exit 2
fi
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run / _stage_exec: what DRY_RUN means in every wrapper
if dry_run; then
  echo "source recipes/setup_cpu_env.sh base"
else
  source recipes/setup_cpu_env.sh base
fi
_stage_exec rm -rf "$OUT"
launch() { _stage_exec accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m ringft "$@"; }
eval_lines() {  # eval_lines MODEL OUTPUT: line retrieval at L and 4L, 5 depths x 8 cases each
  launch eval-lines --model "$1" --output "$2" --prompt-style ringft --lengths 120,500 \
    --depths 0,0.25,0.5,0.75,1 --cases 8 --max-new-tokens 8 --dtype fp32 --attn-backend torch --no-progress
}
echo "== 1/3 base model (trained at 128 tokens): line retrieval at 128 and 512 tokens"
eval_lines "$BASE" "$OUT/eval-before"
echo "== 2/3 context extension: RoPE theta 10K -> 160K, fine-tune at 512 tokens, CP = 2"
launch train recipes/demo/extend.yaml --checkpoint.output_dir "$OUT/extend" "$@"
echo "== 3/3 extended model: line retrieval at 128 and 512 tokens"
eval_lines "$OUT/extend/final" "$OUT/eval-after"
_stage_exec python -m ringft.evals.compare "$OUT/eval-before" "$OUT/eval-after" \
  --labels "base model (before)" "extended (after)" \
  --title "Line retrieval before / after context extension (trained at 128 tokens)" \
  --figure "$OUT/before_after.png" --markdown "$OUT/before_after.md"
