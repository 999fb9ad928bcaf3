#!/usr/bin/env bash
# One lent-GPU session's runs (stages of benchmarks/gpu_validation.sh), in order of value, within a
# deadline: each stage starts only if its expected time is left, and runs under what is left. Logs
# and the traces are packed into two archives under $OUT (the device tool returns at most 8 files).
#   DEADLINE_S=540 bash tools/gpu_session.sh
# Dry run on a CPU (tiny model, lengths / 256, every stage; checks the commands, measures nothing):
#   RINGFT_GPU_TINY=1 DEADLINE_S=600 bash tools/gpu_session.sh
set -uo pipefail
OUT=${OUT:-outputs/gpu}
export OUT
mkdir -p "$OUT"
end=$(( $(date +%s) + ${DEADLINE_S:-540} ))
stage() {
  local need=$1; shift
  [ "${RINGFT_GPU_TINY:-0}" = 1 ] && need=5  # the expected times are the GPU's
  local left=$(( end - $(date +%s) ))
  if [ "$left" -lt "$need" ]; then echo "SKIP $* ($left s left, needs ~$need)"; return; fi
  local start; start=$(date +%s)
  timeout "$left" bash benchmarks/gpu_validation.sh "$@"
  echo "=== $* took $(( $(date +%s) - start )) s"
}
{
  if [ -n "${STAGES:-}" ]; then  # e.g. STAGES="exactness;trace 131072 2": these stages only
    IFS=';' read -ra picked <<< "$STAGES"
    for one in "${picked[@]}"; do stage 10 $one; done
  else
  # capacity (attention tiles, the fused norm backward, attention kept under checkpointing), then
  # ring efficiency, the same-machine baseline, a 32-layer step: in order of value
  T="--train.attention_tile_tokens 65536 --lora.adapter_dtype model --checkpoint.save_final false"
  stage 10 env
  stage 60 tiles
  stage 60 trace 393216 2 $T
  stage 80 trace 524288 2 $T
  stage 40 attnckpt
  stage 150 sharded zero3_offload 393216 2 --train.attention_tile_tokens 65536 --checkpoint.save_final false
  stage 130 ringeff
  stage 60 profile 16384 32
  STEPS=2 stage 200 train 262144 auto --train.attention_tile_tokens 65536 --train.offload_activations true \
    --train.tiled_mlp_tokens 4096 --checkpoint.save_final false
  fi
} 2>&1 | tee "$OUT/session.log"
# pack into a folder outside $OUT first (tar must not read the archive it writes)
pack=$(mktemp -d)
(cd "$OUT" && tar czf "$pack/logs.tgz" --exclude='*.pickle.gz' . && \
  tar czf "$pack/blocks.tgz" $(find . -name '*.pickle.gz') 2>/dev/null)
find "$OUT" -mindepth 1 ! -name session.log -delete
mv "$pack"/*.tgz "$OUT"/ && ls -la "$OUT"
