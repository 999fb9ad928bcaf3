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
# Extra arguments go to recipes/trl_sft/sft.py (--max-steps, --lr, --save-steps, ...).
# Memory per GPU (FSDP2 FULL_SHARD is ZeRO-3 for the planner): 29.1 GiB of 80, and rows of up to
# 950,272 tokens would fit this layout:
#   ringft plan --model llama-3-8b --seq-len 65536 --gpus 8 --gpu-mem 80 --cp 8 --zero 3
# CPU variant (2 processes, SmolLM2-135M, a minute): recipes/trl_sft/run_cpu.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
# less allocator fragmentation at long sequences (see recipes/_stages.sh); a value set before wins
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CMD=(
    "${ACCELERATE:-accelerate}" launch
    --config_file "${ACCELERATE_CONFIG:-recipes/accelerate/fsdp2.yaml}"
    ${LAUNCH_ARGS:-}
    recipes/trl_sft/sft.py
    --model "${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
    --dataset "${DATASET:-HuggingFaceH4/ultrachat_200k}"
    --dataset-split "${DATASET_SPLIT:-train_sft}"
    --max-length "${MAX_LENGTH:-65536}"
    --cp-size "${CP_SIZE:-8}"
    --lora "${LORA:-0}"
    --micro-batch 1
    --grad-accum "${GRAD_ACCUM:-8}"
    --lr "${LR:-2e-5}"
    --bf16
    --gradient-checkpointing
    --output-dir "${OUTPUT_DIR:-outputs/trl_sft}"
    "$@"
)
if dry_run; then
    echo "${CMD[@]}"
else
    "${CMD[@]}"
fi
