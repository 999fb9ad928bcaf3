#!/usr/bin/env bash
# Build the model folder and the training data of recipes/smollm2_32k (both stages), from the repo root:
#
#   SOURCE=data/raw/long_docs.jsonl recipes/smollm2_32k/prepare_data.sh
#
# SOURCE: a corpus of long documents for data_prep/pack.py (a local .jsonl/.parquet/.txt file,
#   folder or glob, or a hub dataset name; TEXT_COLUMN names its text column, default "text").
#   Use long documents (books, code repositories, papers) so sequences hold long-range dependencies.
#   Each stage reads ~26M tokens (100 steps x 256K); a smaller corpus is cycled.
# MODEL: where data_prep/get_smollm2.py puts SmolLM2-135M-Instruct (default models/smollm2-135m-instruct,
#   the recipes' model.name_or_path). RECORDS: line-retrieval records per stage (default 400, about
#   a quarter of the rows a stage reads). NUM_PROC: tokenizer processes for pack.py (default 8).
# Writes data/smollm2-packed-{16k,32k}, data/smollm2-lines-{16k,32k} and the recipes' inputs
# data/smollm2-mix-{16k,32k}; a folder that exists is kept (delete it to build it again).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${SOURCE:?set SOURCE to a corpus of long documents (see the header of this script)}"
MODEL=${MODEL:-models/smollm2-135m-instruct}
RECORDS=${RECORDS:-400}
PYTHON=${PYTHON:-python}

"$PYTHON" data_prep/get_smollm2.py --output "$MODEL"
for S in 16384 32768; do
    K=$((S / 1024))k
    if [[ ! -d data/smollm2-packed-$K ]]; then
        "$PYTHON" data_prep/pack.py --tokenizer "$MODEL" --source "$SOURCE" \
            --text-column "${TEXT_COLUMN:-text}" --seq-len "$S" --num-proc "${NUM_PROC:-8}" \
            --output "data/smollm2-packed-$K"
    fi
    if [[ ! -d data/smollm2-lines-$K ]]; then
        # Records of 2K..S tokens in one user turn of the chat template, loss on the answer only.
        "$PYTHON" data_prep/make_synthetic.py --tokenizer "$MODEL" --num-examples "$RECORDS" \
            --seq-len "$S" --min-len 2048 --seed "$S" --output "data/smollm2-lines-$K"
    fi
    if [[ ! -d data/smollm2-mix-$K ]]; then
        "$PYTHON" recipes/smollm2_32k/mix_data.py --packed "data/smollm2-packed-$K" \
            --lines "data/smollm2-lines-$K" --output "data/smollm2-mix-$K"
    fi
done
