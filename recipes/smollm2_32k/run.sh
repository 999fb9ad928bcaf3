#!/usr/bin/env bash
# SmolLM2-135M-Instruct (8K) -> 32K context: stages 1-2 (16K, 32K) in order, full fine-tuning on
# one GPU (>= 40 GB). Each stage's model.name_or_path is the previous stage's export; stage 1 starts
# from models/smollm2-135m-instruct. Build model and data first (recipes/smollm2_32k/prepare_data.sh),
# and measure line retrieval before and after with recipes/smollm2_32k/measure.sh.
#
#   recipes/smollm2_32k/run.sh [--section.key value ...]         # overrides apply to every stage
#   NUM_GPUS=2 recipes/smollm2_32k/run.sh --parallel.cp_size 2    # a ring of 2 GPUs
#   STAGES="2" recipes/smollm2_32k/run.sh                          # only some stages
#   DRY_RUN=1 recipes/smollm2_32k/run.sh                           # print the commands
# Needs a GPU: on 2 CPU cores a single 16K step of this model takes minutes. Re-running continues an
# interrupted stage (--resume) and skips finished ones. More knobs: recipes/_stages.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh

RECIPES=(
    recipes/smollm2_32k/stage1_16k.yaml
    recipes/smollm2_32k/stage2_32k.yaml
)
DEFAULT_CONFIG=recipes/accelerate/1node_8gpu.yaml  # plain DDP (NCCL, bf16); the model fits one GPU
LAUNCH_ARGS=${LAUNCH_ARGS:---num_processes ${NUM_GPUS:-1}}
run_stages "$@"
