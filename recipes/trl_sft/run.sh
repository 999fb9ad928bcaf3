#!/usr/bin/env bash
# Chat SFT with TRL's SFTTrainer on one 8-GPU node: documents packed into 64K-token rows (bfd,
# padding-free), each row on a ring of 8 GPUs (cp 8, dp 1) through ringft.RingTrainerMixin, full
# fine-tuning under FSDP2, bf16, activation checkpointing; 8 rows (512K tokens) per optimizer step.
#
#   recipes/trl_sft/run.sh                                  # Llama-3.1-8B-Instruct on UltraChat
#   MODEL=mistralai/Mistral-7B-Instruct-v0.3 recipes/trl_sft/run.sh
#   LORA=16 ACCELERATE_CONFIG=recipes/accelerate/1node_8gpu.yaml recipes/trl_sft/run.sh   # LoRA, DDP
#   CP_SIZE=4 MAX_LENGTH=32768 recipes/trl_sft/run.sh      # two rings of 4 (dp 2)
#   DRY_RUN=1 recipes/trl_sft/run.sh                        # print the command
# Extra arguments go to recipes/trl_sft/sft.py: TRL's flags (--max_steps, --learning_rate,
# --save_strategy steps --save_steps 100, ...) and ringft's --cp_size / --ulysses_size.
# Memory per GPU (FSDP2 FULL_SHARD is ZeRO-3 for the planner): 29.0 GiB of 80, and rows of up to
# 1,015,808 tokens would fit this layout:
#   ringft plan --model llama-3-8b --seq-len 65536 --gpus 8 --gpu-mem 80 --cp 8 --zero 3
# CPU variant (2 processes, SmolLM2-135M, a minute): recipes/trl_sft/run_cpu.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
# less allocator fragmentation at long sequences (see recipes/_stages.sh); a value set before wins
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# LORA=R: a LoRA adapter of rank R on the attention projections (0: full fine-tuning)
PEFT=()
if [[ "${LORA:-0}" != 0 ]]; then
    PEFT=(--use_peft true --lora_r "$LORA" --lora_alpha $((2 * LORA)) --lora_dropout 0
        --lora_target_modules q_proj k_proj v_proj o_proj)
fi
# sft.py takes TRL's own flags (TrlParser: ScriptArguments, SFTConfig, ModelConfig) + --cp_size
CMD=(
    "${ACCELERATE:-accelerate}" launch
    --config_file "${ACCELERATE_CONFIG:-recipes/accelerate/fsdp2.yaml}"
    ${LAUNCH_ARGS:-}
    recipes/trl_sft/sft.py
    --model_name_or_path "${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
    --dtype bfloat16
    --dataset_name "${DATASET:-HuggingFaceH4/ultrachat_200k}"
    --dataset_train_split "${DATASET_SPLIT:-train_sft}"
    --dataset_test_split "${DATASET_TEST_SPLIT:-test_sft}"  # read with --eval_strategy steps
    --packing true
    --max_length "${MAX_LENGTH:-65536}"
    --cp_size "${CP_SIZE:-8}"
    "${PEFT[@]}"
    --per_device_train_batch_size 1
    --gradient_accumulation_steps "${GRAD_ACCUM:-8}"
    --learning_rate "${LR:-2e-5}"
    --lr_scheduler_type cosine
    --warmup_steps 0.03
    --num_train_epochs 1
    --bf16 true
    --activation_checkpointing true
    --logging_steps 1
    --save_strategy no
    --report_to none
    --output_dir "${OUTPUT_DIR:-outputs/trl_sft}"
    "$@"
)
_stage_exec "${CMD[@]}"  # DRY_RUN: prints the command, quoted (re-runnable)
