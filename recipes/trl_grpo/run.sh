#!/usr/bin/env bash
# GRPO with TRL's GRPOTrainer on one 8-GPU node: long prompts (up to 64K tokens) + their sampled
# completions scored on a ring of 8 GPUs (cp 8, dp 1) through ringft.RingGRPOTrainer (generation:
# HF generate, or --use_vllm true --vllm_mode server), full fine-tuning under DeepSpeed ZeRO-3,
# bf16, activation checkpointing, the KL term against the reference model.
#
#   recipes/trl_grpo/run.sh                                  # Qwen2.5-7B-Instruct, made-up sums
#   CP_SIZE=4 recipes/trl_grpo/run.sh                        # two rings of 4 (dp 2)
#   DATASET=my_prompts.jsonl recipes/trl_grpo/run.sh --use_peft --lora_r 16
#   DRY_RUN=1 recipes/trl_grpo/run.sh                        # print the command
# Extra arguments go to recipes/trl_grpo/grpo.py (any GRPOConfig / ModelConfig option: --loss_type dapo, ...).
# CPU variant (2 processes, SmolLM2-135M): recipes/trl_grpo/run_cpu.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CMD=(
    "${ACCELERATE:-accelerate}" launch
    --config_file "${ACCELERATE_CONFIG:-recipes/accelerate/deepspeed_zero3.yaml}"
    ${LAUNCH_ARGS:-}
    recipes/trl_grpo/grpo.py
    --model_name_or_path "${MODEL:-Qwen/Qwen2.5-7B-Instruct}"
    --dataset_name "${DATASET:-synthetic-sums:4096}"
    --cp_size "${CP_SIZE:-8}"
    --per_device_train_batch_size 8 --num_generations 8
    --max_completion_length "${MAX_COMPLETION:-1024}"
    --gradient_accumulation_steps "${GRAD_ACCUM:-4}"
    --learning_rate "${LR:-1e-6}"
    --beta 0.04 --loss_type dapo
    --dtype bfloat16 --bf16 true --gradient_checkpointing true
    --logging_steps 1 --save_strategy no --report_to none
    --output_dir "${OUTPUT_DIR:-outputs/trl_grpo}"
    "$@"
)
_stage_exec "${CMD[@]}"  # DRY_RUN: prints the command, quoted (re-runnable)
