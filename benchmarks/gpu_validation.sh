#!/usr/bin/env bash
# GPU validation stages, run from the repo root on a CUDA machine; logs go to $OUT (default
# outputs/gpu). Stages: env | kernels | bench | train SEQ BACKEND [EXTRA...] | baseline SEQ |
# trace SEQ LAYERS [EXTRA...] (LoRA + offloaded activations, the peak's live tensors) |
# sharded fsdp2|fsdp|zero3|zero3_offload SEQ LAYERS (full fine-tuning under that launch config) |
# windows BACKEND (the windowed ring at 128K) | ringeff (cuDNN ring vs one fused call, emulated N = 8,
# 64K / 128K / 256K) | profile SEQ LAYERS (plain transformers + SDPA vs ringft, one profiled step each) |
# tiles (attention in query tiles: transient memory) | attnckpt (attention saved under checkpointing).
#   bash benchmarks/gpu_validation.sh env kernels bench
#   bash benchmarks/gpu_validation.sh train 32768 auto
# RINGFT_GPU_TINY=1 shrinks the model. Without CUDA it is a dry run of the stages that
# tools/gpu_session.sh runs (env, tiles, trace, attnckpt, sharded, ringeff, profile, train): the
# lengths / 256 (at least 64 tokens), the CPU device, the torch backend and fp32 where a stage picks
# the kernel, the resident set instead of CUDA memory statistics. It checks that the commands run;
# its figures are not measurements.
set -euo pipefail
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRY=0  # 1: RINGFT_GPU_TINY=1 on a machine without CUDA (a CPU dry run)
if [ "${RINGFT_GPU_TINY:-0}" = 1 ] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  DRY=1
  # DeepSpeed's CPU ops (CPU Adam) where the test suite builds them, unless the caller chose a folder
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
fi
# a length in tokens as given for the GPU; in a dry run / 256, at least 64
tok() { if [ "$DRY" = 1 ]; then local t=$(( $1 / 256 )); echo $(( t < 64 ? 64 : t )); else echo "$1"; fi; }
# the value $2 of an EXTRA option $1: in a dry run a *_tokens value through tok
val() { if [ "$DRY" = 1 ] && [[ $1 == *_tokens ]]; then tok "$2"; else echo "$2"; fi; }
if [ "${RINGFT_GPU_TINY:-0}" = 1 ]; then
  CONFIG="{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 524288, vocab_size: 2048}"
else
  CONFIG="{hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 524288, vocab_size: 128256, rope_theta: 500000}"
fi
TARGETS="[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
# the Llama-3-8B layer shape with LAYERS layers and vocabulary VOCAB (planner: --config-json of it)
shape() {
  if [ "${RINGFT_GPU_TINY:-0}" = 1 ]; then echo "$CONFIG"; return; fi
  echo "{hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: $1, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 524288, vocab_size: $2, rope_theta: 500000}"
}
COMMON=(--model.dtype bf16 --model.attn_backend auto --parallel.cp_size 1 --train.micro_batch_size 1
  --train.warmup_steps 0 --train.gradient_checkpointing true --train.loss_chunk_size 4096 --train.lr 1e-5
  --checkpoint.save_every 0 --logging.tracker none --logging.log_every 1)
# tests/ops/test_cudnn_backend.py's whole grid against fp64, every line logged; prints the failures
cudnn_exactness() {
  python3 tests/ops/test_cudnn_backend.py > "$OUT/cudnn_exactness.log" 2>&1 || true
  grep -E "tiny|FAIL|failures" "$OUT/cudnn_exactness.log" | head -30
}
while [ $# -gt 0 ]; do
  stage=$1; shift
  case $stage in
    env)
      if command -v nvidia-smi > /dev/null; then nvidia-smi || true; else echo "no nvidia-smi (dry run: $DRY)"; fi
      python3 -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"
      ;;
    exactness)
      cudnn_exactness
      ;;
    kernels)  # the torch backend's CUDA grid (pytest), then the cuDNN grid once, line by line
      python3 -m pytest -q -p no:cacheprovider tests/ops/test_cuda_backend.py 2>&1 | tail -5 || true
      cudnn_exactness
      ;;
    bench)
      python3 benchmarks/bench_backends_cuda.py --seq 16K,64K,128K --ring-seq 128K --json "$OUT/backends.jsonl"
      ;;
    train)
      seq=$(tok "$1") backend=$2; shift 2
      extra=()
      while [ $# -gt 0 ] && [[ $1 == --* ]]; do extra+=("$1" "$(val "$1" "$2")"); shift 2; done
      tag=train-$seq-$backend-$(echo "${extra[*]:-}" | tr -c 'a-z0-9' '_' | cut -c1-40)
      dir=/tmp/ringft-$tag
      rm -rf "$dir"
      start=$(date +%s)
      python3 -m ringft train recipes/demo_cpu.yaml --model.config "$CONFIG" --model.dtype bf16 \
        --model.attn_backend "$backend" --data.synthetic "{task: repeat, num_examples: 16}" \
        --data.seq_len "$seq" --parallel.cp_size 1 --train.micro_batch_size 1 --train.max_steps "${STEPS:-4}" \
        --train.warmup_steps 0 --train.gradient_checkpointing true --train.loss_chunk_size 4096 \
        --train.lr 1e-5 --lora "{r: 16, target_modules: $TARGETS}" --checkpoint.output_dir "$dir" \
        --checkpoint.save_every 0 --logging.tracker none --logging.log_every 1 "${extra[@]}" \
        > "$OUT/$tag.log" 2>&1 || echo "$tag FAILED (see log)"
      echo "$tag wall $(( $(date +%s) - start )) s"
      grep -E "auto' uses|ringft:|Error|error" "$OUT/$tag.log" | tail -3 || true
      [ -f "$dir/metrics.jsonl" ] && cp "$dir/metrics.jsonl" "$OUT/$tag.metrics.jsonl" && \
        python3 benchmarks/bench_train_gpu.py summary --seq "$seq" --lora "$dir/metrics.jsonl"
      ;;
    baseline)
      seq=$1; shift
      python3 benchmarks/bench_train_gpu.py baseline --seq "$seq" --steps 4
      ;;
    trace)
      seq=$(tok "$1") layers=$2; shift 2
      extra=()
      while [ $# -gt 0 ] && [[ $1 == --* ]]; do extra+=("$1" "$(val "$1" "$2")"); shift 2; done
      tag=trace-$seq-L$layers
      rm -rf "/tmp/ringft-$tag"
      python3 benchmarks/gpu_memory_trace.py --out "$OUT/$tag" --cap-gib "${CAP_GIB:-79.6}" -- \
        recipes/demo_cpu.yaml --model.config "$(shape "$layers" 128256)" "${COMMON[@]}" \
        --data.synthetic "{task: repeat, num_examples: 4}" --data.seq_len "$seq" --train.max_steps 1 \
        --train.tiled_mlp_tokens "$(tok 4096)" --train.offload_activations true \
        --lora "{r: 16, target_modules: $TARGETS}" --checkpoint.output_dir "/tmp/ringft-$tag" \
        "${extra[@]}" > "$OUT/$tag.log" 2>&1 || echo "$tag FAILED (see log)"
      grep -E "^(result|events)" "$OUT/$tag/peak.txt" 2>/dev/null || tail -5 "$OUT/$tag.log"
      rm -rf "/tmp/ringft-$tag"
      ;;
    ringeff)
      if [ "$DRY" = 1 ]; then
        python3 benchmarks/bench_backends_cuda.py --device cpu --dtype fp32 --backends torch --seq 512,1024 \
          --ring-seq 512,1024 --ring-world 8 --heads 4 --kv-heads 2 --head-dim 32 --repeats 1 \
          --json "$OUT/ringeff.jsonl"
        continue
      fi
      python3 benchmarks/bench_backends_cuda.py --seq "${RING_SEQ:-64K,128K,256K}" --ring-seq "${RING_SEQ:-64K,128K,256K}" \
        --ring-world 8 --backends cudnn --repeats 3 --json "$OUT/ringeff.jsonl" 2>&1 | grep -v Warning
      ;;
    profile)
      seq=$(tok "$1") layers=$2; shift 2
      [ "$DRY" = 1 ] && layers=2
      python3 benchmarks/bench_step_profile.py --seq "$seq" --layers "$layers" --json "$OUT/profile.jsonl" 2>&1 \
        | grep -E '^\{|Error' || true
      ;;
    tiles)
      if [ "$DRY" = 1 ]; then
        python3 benchmarks/bench_attention_tiles.py --device cpu --backend torch --dtype fp32 --seq 256,512 \
          --tiles 64,128 --heads 4 --kv-heads 2 --head-dim 32 --repeats 1 2>&1 | tail -15
        continue
      fi
      python3 benchmarks/bench_attention_tiles.py --device cuda --backend cudnn --dtype bf16 --seq 64K,128K,256K \
        --tiles 4096,16384 --heads 32 --kv-heads 8 --head-dim 128 2>&1 | tail -15
      ;;
    attnckpt)
      if [ "$DRY" = 1 ]; then
        python3 benchmarks/bench_attention_checkpoint.py --device cpu --dtype fp32 --seq 512 --hidden 64 \
          --heads 4 --kv-heads 2 --intermediate 128 --layers 2 --vocab 2048 --warmup 1 --steps 1 --threads 1 \
          2>&1 | tail -15
        continue
      fi
      python3 benchmarks/bench_attention_checkpoint.py --device cuda --dtype bf16 --seq 131072 --hidden 4096 \
        --heads 32 --kv-heads 8 --intermediate 14336 --layers 2 --vocab 32000 --steps 3 2>&1 | tail -15
      ;;
    sharded)
      kind=$1 seq=$(tok "$2") layers=$3; shift 3
      extra=()
      while [ $# -gt 0 ] && [[ $1 == --* ]]; do extra+=("$1" "$(val "$1" "$2")"); shift 2; done
      case $kind in
        fsdp2) cfg=fsdp2.yaml ;; fsdp) cfg=fsdp.yaml ;; zero3) cfg=deepspeed_zero3.yaml ;;
        zero3_offload) cfg=deepspeed_zero3_offload.yaml ;; *) echo "unknown $kind"; exit 2 ;;
      esac
      tag=sharded-$kind-$seq-L$layers dir=/tmp/ringft-sharded
      rm -rf "$dir"
      start=$(date +%s)
      accelerate launch --config_file "recipes/accelerate/$cfg" --num_processes 1 -m ringft train \
        recipes/demo_cpu.yaml --model.config "$(shape "$layers" 32000)" "${COMMON[@]}" \
        --data.synthetic "{task: repeat, num_examples: 8}" --data.seq_len "$seq" --train.max_steps "${STEPS:-3}" \
        --checkpoint.output_dir "$dir" "${extra[@]}" > "$OUT/$tag.log" 2>&1 || echo "$tag FAILED (see log)"
      echo "$tag wall $(( $(date +%s) - start )) s"
      grep -E "ringft:|Error" "$OUT/$tag.log" | tail -3 || true
      [ -f "$dir/metrics.jsonl" ] && cp "$dir/metrics.jsonl" "$OUT/$tag.metrics.jsonl" && tail -2 "$dir/metrics.jsonl"
      du -sh "$dir" 2>/dev/null || true
      rm -rf "$dir"
      ;;
    windows)
      backend=$1; shift
      python3 benchmarks/bench_windows.py --device cuda --dtype bf16 --backend "$backend" --seq 128K \
        --world 4 --heads 32 --kv-heads 8 --windows 512,4096,32768 --repeats 3 2>&1 | tail -12
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
