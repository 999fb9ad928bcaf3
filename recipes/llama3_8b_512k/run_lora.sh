#!/usr/bin/env bash
# Llama-3-8B 512K LoRA stage (stage4_512k_lora.yaml) on 1 node x 8 GPUs with plain DDP: no ZeRO-3.
# It starts from stage 3's full fine-tune, outputs/llama3_8b_512k/stage3_256k/final; make that
# first with `STAGES="1 2 3" recipes/llama3_8b_512k/run.sh`, or start from the hub model with
# `--model.name_or_path meta-llama/Meta-Llama-3-8B` (a cheaper, weaker one-stage extension).
#
#   recipes/llama3_8b_512k/run_lora.sh [--section.key value ...]
#   ACCELERATE_CONFIG=recipes/accelerate/2node_8gpu.yaml LAUNCH_ARGS="--main_process_ip IP --machine_rank R" \
#       recipes/llama3_8b_512k/run_lora.sh --train.grad_accum 1     # 2 nodes: dp 2 x cp 8
#   (2 nodes as one CP group, Ulysses 8 x ring 2: --parallel.cp_size 16 --parallel.ulysses_size 8)
#   DRY_RUN=1 recipes/llama3_8b_512k/run_lora.sh                    # print the command
# The result, outputs/llama3_8b_512k/stage4_512k_lora/final, is a peft adapter: see the recipe's
# header for loading it with the 512K RoPE settings.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh

RECIPES=(recipes/llama3_8b_512k/stage4_512k_lora.yaml)
DEFAULT_CONFIG=recipes/accelerate/1node_8gpu.yaml
run_stages "$@"
