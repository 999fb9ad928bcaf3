#!/usr/bin/env bash
# Line-retrieval accuracy of SmolLM2-135M-Instruct before and after recipes/smollm2_32k, at 4K, 8K,
# 16K and 32K tokens (depths 0..1), with `ringft eval-lines` on the CP ring; then a before/after
# table and one figure per prompt style (python -m ringft.evals.compare). From the repo root:
#
#   recipes/smollm2_32k/measure.sh [extra eval-lines flags ...]
#   NUM_GPUS=2 recipes/smollm2_32k/measure.sh --cp-size 2     # a ring of 2 GPUs per case
#   SIDES=before recipes/smollm2_32k/measure.sh               # the base model only (before training)
#   DRY_RUN=1 recipes/smollm2_32k/measure.sh                  # print the commands
#
# BEFORE / AFTER: the two models (default models/smollm2-135m-instruct and the recipe's export
#   outputs/smollm2_32k/stage2_32k/final). STYLES: prompt styles (default "ringft longchat":
#   ringft = the wording of the training records, longchat = LongChat's benchmark wording).
# LENGTHS, DEPTHS, CASES: the grid (default 4096,8192,16384,32768 / 0,0.25,0.5,0.75,1 / 5).
# OUT: results folder (default outputs/smollm2_32k/eval): <before|after>-<style>/ per run (re-running
#   resumes them) and before_after-<style>.png / .md. The 8K model is evaluated past its trained
#   positions at 16K and 32K (eval-lines says so once): that extrapolation is the "before".
# Needs a GPU for 16K and 32K (on 2 CPU cores one 32K case takes many minutes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=recipes/_stages.sh
source recipes/_stages.sh  # dry_run: what DRY_RUN means in every wrapper
BEFORE=${BEFORE:-models/smollm2-135m-instruct}
AFTER=${AFTER:-outputs/smollm2_32k/stage2_32k/final}
OUT=${OUT:-outputs/smollm2_32k/eval}
CONFIG=${ACCELERATE_CONFIG:-recipes/accelerate/1node_8gpu.yaml}

run() { _stage_exec "$@"; }  # DRY_RUN: prints the command

for style in ${STYLES:-ringft longchat}; do
    for side in ${SIDES:-before after}; do
        model=$BEFORE
        [[ $side == after ]] && model=$AFTER
        if ! dry_run && [[ ! -d "$model" ]]; then
            echo "error: $side model $model does not exist (prepare_data.sh makes the base, run.sh the extended)" >&2
            exit 1
        fi
        run "${ACCELERATE:-accelerate}" launch --config_file "$CONFIG" --num_processes "${NUM_GPUS:-1}" \
            -m ringft eval-lines --model "$model" --prompt-style "$style" \
            --lengths "${LENGTHS:-4096,8192,16384,32768}" --depths "${DEPTHS:-0,0.25,0.5,0.75,1}" \
            --cases "${CASES:-5}" --output "$OUT/$side-$style" "$@"
    done
    [[ "${SIDES:-before after}" == "before after" ]] || continue
    run "${PYTHON:-python}" -m ringft.evals.compare "$OUT/before-$style" "$OUT/after-$style" \
        --labels "SmolLM2-135M (8K)" "smollm2_32k (32K)" --title "line retrieval, prompt style $style" \
        --figure "$OUT/before_after-$style.png" --markdown "$OUT/before_after-$style.md"
done
