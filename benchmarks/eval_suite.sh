#!/usr/bin/env bash
# The long-context evaluation suite on CPU with CP = 2 (benchmarks/RESULTS.md, "Long-context evaluation
# suite"): SmolLM2-135M-Instruct at 2K, 4K, 8K (its trained length) and 16K, and the demo base model
# before / after context extension. Every run is resumable: re-running a part skips finished cases.
#
#   bash benchmarks/eval_suite.sh demo            # demo base vs extended: eval-ppl, eval-lines, eval-short
#   bash benchmarks/eval_suite.sh smollm2-ppl     # perplexity by length, + SmolLM2 limited to its 8K window
#   bash benchmarks/eval_suite.sh smollm2-niah    # passkey + needle, 4 lengths x 3 depths, 1 sample per cell
#   bash benchmarks/eval_suite.sh smollm2-ruler   # 6 RULER tasks x 4 lengths, 1 sample per cell
#   bash benchmarks/eval_suite.sh report          # outputs/evals/report.md (+ .html)
#
# Environment: OUT (default outputs/evals), SAMPLES (default 1), PORT (default 29531).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/evals}
SAMPLES=${SAMPLES:-1}
PORT=${PORT:-29531}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
launch() {
  nice -n 10 accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml --main_process_port "$PORT" \
    -m ringft "$@" --dtype fp32 --attn-backend torch --no-progress
}
smollm2() { python data_prep/get_smollm2.py --output "${RINGFT_CACHE:-$HOME/.cache/ringft}/smollm2-135m-instruct"; }
pydoc_text() {  # Python's own reference documentation (pydoc_data.topics, PSF licence): ~170K tokens
  python -c "from pydoc_data.topics import topics; print('\n\n'.join(topics[k] for k in sorted(topics)))" \
    > "$OUT/pydoc.txt"
}
LENGTHS=2048,4096,8192,16384

case "${1:-}" in
demo)
  D=$OUT/demo
  mkdir -p "$D"
  python - "$D/records.jsonl" <<'EOF'
import json, sys
from ringft.data.line_retrieval import make_line_cases
from ringft.data.tokenizer import load_demo_tokenizer
# Held-out line-retrieval records (seed 123, not a training seed) in the demo's own wording.
cases = make_line_cases(load_demo_tokenizer(), [600], [0.5], 16, seed=123, prompt_style="ringft")
with open(sys.argv[1], "w") as fh:
    fh.writelines(json.dumps({"text": c.prompt + " " + c.answer}) + "\n" for c in cases)
EOF
  BASE=ringft/assets/demo_base
  [[ -f "$D/extend/final/config.json" ]] ||
    nice -n 10 accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml --main_process_port "$PORT" \
      -m ringft train recipes/demo/extend.yaml --checkpoint.output_dir "$D/extend" --no-progress
  EXT=$D/extend/final
  for name in base extended; do
    model=$BASE; [[ $name == extended ]] && model=$EXT
    launch eval-ppl --model "$model" --baseline "$BASE" --text "$D/records.jsonl" --concat --lengths 64,128,256,512 \
      --output "$D/$name-ppl"
    launch eval-lines --model "$model" --prompt-style ringft --lengths 120,500 --depths 0,0.25,0.5,0.75,1 \
      --cases 8 --max-new-tokens 8 --output "$D/$name-lines"
  done
  launch eval-short --model "$EXT" --baseline "$BASE" --text "$D/records.jsonl" --output "$D/extended-short"
  ;;
smollm2-ppl)
  pydoc_text
  M=$(smollm2)
  launch eval-ppl --model "$M" --baseline "$M" --text "$OUT/pydoc.txt" --concat --num-docs 2 --lengths $LENGTHS \
    --output "$OUT/smollm2-ppl"
  ;;
smollm2-niah)
  launch eval-niah --model "$(smollm2)" --lengths $LENGTHS --depths 0,0.5,1 --samples "$SAMPLES" \
    --output "$OUT/smollm2-niah"
  ;;
smollm2-ruler)
  launch eval-ruler --model "$(smollm2)" --lengths $LENGTHS --samples "$SAMPLES" --output "$OUT/smollm2-ruler"
  ;;
report)
  for ext in md html; do
    python -m ringft eval-report "$OUT"/smollm2-{ppl,niah,ruler} "$OUT"/demo/{base,extended}-{ppl,lines} \
      "$OUT/demo/extended-short" --output "$OUT/report.$ext" \
      --labels "SmolLM2-135M" "SmolLM2-135M" "SmolLM2-135M" "demo base" "demo base" "demo extended" \
      "demo extended" "demo extended vs base"
  done
  ;;
*)
  sed -n '2,13p' "$0" >&2
  exit 2
  ;;
esac
