#!/usr/bin/env bash
# DPO with TRL's DPOTrainer on one 8-GPU node: each pair's prompt + chosen and prompt + rejected
# rows (up to 64K tokens) on a ring of 8 GPUs (cp 8, dp 1) through ringft.RingDPOTrainer, full
# fine-tuning under DeepSpeed ZeRO-3, bf16, activation checkpointing, the reference log-probs
# precomputed on the ring before training (no reference model in memory during training).
#
#   recipes/trl_dpo/run.sh                                  # Llama-3.1-8B-Instruct on UltraFeedback
#   CP_SIZE=4 MAX_LENGTH=32768 recipes/trl_dpo/run.sh       # two rings of 4 (dp 2)
#   ACCELERATE_CONFIG=recipes/accelerate/1node_8gpu.yaml recipes/trl_dpo/run.sh --use_peft --lora_r 16
#   DRY_RUN=1 recipes/trl_dpo/run.sh                        # print the command
# Extra arguments go to recipes/trl_dpo/dpo.py (any DPOConfig / ModelConfig option: --loss_type ipo, ...).
# CPU variant (2 processes, SmolLM2-135M): recipes/trl_dpo/run_cpu.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CMD=(
    "${ACCELERATE:-accelerate}" launch
    --config_file "${ACCELERATE_CONFIG:-recipes/accelerate/deepspeed_zero3.yaml}"
    ${LAUNCH_ARGS:-}
    recipes/trl_dpo/dpo.py
    --model_name_or_path "${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
    --dataset_name "${DATASET:-trl-lib/ultrafeedback_binarized}"
    --max_length "${MAX_LENGTH:-65536}"
    --cp_size "${CP_SIZE:-8}"
    --per_device_train_batch_size 1
    --gradient_accumulation_steps "${GRAD_ACCUM:-8}"
    --learning_rate "${LR:-5e-7}"
    --beta 0.1
    --precompute_ref_log_probs true
    --dtype bfloat16 --bf16 true --gradient_checkpointing true
    --logging_steps 1 --save_strategy no --report_to none
    --output_dir "${OUTPUT_DIR:-outputs/trl_dpo}"
    "$@"
)
_stage_exec "${CMD[@]}"  # DRY_RUN: prints the command, quoted (re-runnable)
