#!/usr/bin/env bash
# The CPU variant of recipes/trl_grpo/run.sh: SmolLM2-135M-Instruct (real weights, no model hub:
# data_prep/get_smollm2.py builds it from a pip package), made-up arithmetic questions, two
# rule-based rewards, 4 sampled completions per prompt, LoRA r 8 (beta 0.05: the reference is the
# adapter disabled), two CPU processes forming one ring (cp 2), fp32 (--use_cpu true: else
# accelerate would train each CPU process alone).
#
#   recipes/trl_grpo/run_cpu.sh                    # the ring (2 processes)
#   ONE_PROCESS=1 recipes/trl_grpo/run_cpu.sh      # the same run as plain TRL in one process (the oracle)
#   MODEL=path/to/model OUTPUT_DIR=out recipes/trl_grpo/run_cpu.sh --max_steps 4
#   DRY_RUN=1 recipes/trl_grpo/run_cpu.sh          # print the command
# tests/train/test_trl_recipes.py runs both and compares their logs step by step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
PYTHON=${PYTHON:-python}
MODEL=$(smollm2_model)  # $MODEL, or SmolLM2 built on first use (recipes/_stages.sh)
ARGS=(
    --model_name_or_path "$MODEL"
    --dataset_name synthetic-sums:32
    --use_peft --lora_r 8 --lora_alpha 16 --lora_target_modules q_proj k_proj v_proj o_proj
    --per_device_train_batch_size 4 --num_generations 4
    --max_completion_length 12 --temperature 1.0
    --learning_rate 1e-3
    --beta 0.05
    --max_steps 1
    --bf16 false --gradient_checkpointing false --use_cpu true
    --logging_steps 1 --save_strategy no --report_to none --disable_tqdm true
    --output_dir "${OUTPUT_DIR:-outputs/trl_grpo_cpu}"
)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ -n "${ONE_PROCESS:-}" ]]; then
    CMD=("$PYTHON" recipes/trl_grpo/grpo.py "${ARGS[@]}" --cp_size 1 "$@")
else
    CMD=("${ACCELERATE:-accelerate}" launch --config_file recipes/accelerate/cpu_2proc.yaml ${LAUNCH_ARGS:-}
        recipes/trl_grpo/grpo.py "${ARGS[@]}" --cp_size 2 "$@")
fi
_stage_exec "${CMD[@]}"  # DRY_RUN: prints the command, quoted (re-runnable)
