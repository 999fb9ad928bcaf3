#!/usr/bin/env bash
# Llama-3-8B -> 512K context: stages 1-4 (64K, 128K, 256K, 512K) in order, full fine-tuning on
# 1 node x 8 x 80 GB GPUs under DeepSpeed ZeRO-3. Each stage's model.name_or_path is the previous
# stage's outputs/llama3_8b_512k/<stage>/final. Build the data first (stage1_64k.yaml's header).
#
#   recipes/llama3_8b_512k/run.sh [--section.key value ...]     # overrides apply to every stage
#   STAGES="3 4" recipes/llama3_8b_512k/run.sh                  # only some stages
#   ACCELERATE_CONFIG=recipes/accelerate/deepspeed_zero3_offload.yaml recipes/llama3_8b_512k/run.sh
#   DRY_RUN=1 recipes/llama3_8b_512k/run.sh                     # print the commands
# Re-running continues an interrupted stage (--resume) and skips finished ones. More knobs
# (LAUNCH_ARGS for multi-node, ...): recipes/_stages.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh

RECIPES=(
    recipes/llama3_8b_512k/stage1_64k.yaml
    recipes/llama3_8b_512k/stage2_128k.yaml
    recipes/llama3_8b_512k/stage3_256k.yaml
    recipes/llama3_8b_512k/stage4_512k.yaml
)
DEFAULT_CONFIG=recipes/accelerate/deepspeed_zero3.yaml  # ZeRO-3 (tested); fsdp.yaml: see recipes/README.md
run_stages "$@"
