# shellcheck shell=bash
# Shared by the recipe wrappers (recipes/*/run*.sh); sourced, not run. It launches recipe stages
# in order under `accelerate launch ... -m ringft train STAGE.yaml --resume [overrides]`.
#
# The wrapper sets, before calling `run_stages "$@"`:
#   RECIPES=(a.yaml b.yaml ...)   the stages, in order
#   DEFAULT_CONFIG=...            the accelerate launch config
# The user may set:
#   ACCELERATE_CONFIG=path        another launch config (e.g. recipes/accelerate/fsdp.yaml)
#   LAUNCH_ARGS="..."             extra `accelerate launch` flags (e.g. multi-node: --num_machines 2
#                                 --num_processes 16 --machine_rank 0 --main_process_ip 10.0.0.1)
#   STAGES="3 4"                  run only these stages (1-based; default: all)
#   DRY_RUN=1                     print the commands instead of running them (1/true/yes/on;
#                                 0/false/no/off or unset: run; anything else is refused). Every
#                                 wrapper reads it through dry_run below: DRY_RUN=true never trains.
#   PYTHON / ACCELERATE           the interpreter / launcher to use (default: python / accelerate)
# Arguments are ringft overrides (--section.key value ...), passed to every stage.
# Before the first stage starts, every selected stage's data.path (and data.eval_path) must exist,
# and the first one's start model if it is a local folder (all missing folders are named at once: a
# 4-stage run must not fail hours in, at stage 2, for want of its data).
# Each stage runs with --resume (it continues from its newest complete checkpoint, or starts
# fresh) and is skipped once its output_dir/final/ringft_recipe.json exists (the export is done):
# re-running a wrapper after a crash continues where it stopped. Delete a stage's output_dir to
# train it again. checkpoint.output_dir and model.name_or_path are overridden for one stage only
# (STAGES=N; refused for several): every stage reads the previous stage's output_dir/final.

_stage_yaml_get() {  # _stage_yaml_get FILE dotted.key -> the value, printed
    "${PYTHON:-python}" - "$1" "$2" <<'PYEOF'
import sys

import yaml

node = yaml.safe_load(open(sys.argv[1]))
for part in sys.argv[2].split("."):
    node = (node or {}).get(part)
print("" if node is None else node)
PYEOF
}

_stage_override() {  # _stage_override dotted.key ARGS... -> value of --dotted.key in ARGS, if any
    # Read as `ringft train` reads overrides: `--a.b value` or `--a.b=value`, the last one wins.
    local key=$1 found=""
    shift
    while (($#)); do
        local flag=${1%%=*} value
        if [[ "$1" == --no-progress || "$1" == --resume* ]]; then # ringft train's own flags
            [[ "$1" == --resume && $# -ge 2 && "$2" != -* ]] && shift # (--resume PATH)
            shift
            continue
        elif [[ "$1" == --*=* ]]; then
            value=${1#*=}
            shift
        elif (($# >= 2)); then
            value=$2
            shift 2
        else
            break
        fi
        [[ "${flag//-/_}" == "__${key}" ]] && found=$value
    done
    [[ -z "$found" ]] || printf '%s\n' "$found"
}

dry_run() {  # dry_run -> status 0 when DRY_RUN asks for printing instead of running
    case "${DRY_RUN:-}" in
        1 | [Tt]rue | TRUE | [Yy]es | YES | [Oo]n | ON) return 0 ;;
        "" | 0 | [Ff]alse | FALSE | [Nn]o | NO | [Oo]ff | OFF) return 1 ;;
        *)
            echo "error: DRY_RUN=$DRY_RUN: use 1 (print the commands) or 0 (run them)" >&2
            exit 2
            ;;
    esac
}

smollm2_model() {  # the CPU variants' model: $MODEL, else SmolLM2 built by data_prep/get_smollm2.py
    # (a 93 MB download and a conversion on first use: under DRY_RUN only its folder is printed)
    if [[ -n "${MODEL:-}" ]]; then
        printf '%s\n' "$MODEL"
    elif dry_run; then
        printf '%s\n' models/smollm2-135m-instruct
    else
        "${PYTHON:-python}" data_prep/get_smollm2.py --output models/smollm2-135m-instruct | tail -n 1
    fi
}

_stage_exec() {
    if dry_run; then
        printf '%q ' "$@"
        printf '\n'
    else
        "$@"
    fi
}

run_stages() {
    dry_run || true # an invalid DRY_RUN is refused first, even when every stage is done already
    # Long sequences fragment torch's caching allocator: at 384K tokens on an H200 it held 13.8 GiB
    # reserved but unallocated when a step ran out of memory; expandable segments cut that to
    # 0.17 GiB (benchmarks/RESULTS.md, "Planner against measured memory"). A value the user set wins.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    local config=${ACCELERATE_CONFIG:-$DEFAULT_CONFIG}
    local -a launch_args=()
    if [[ -n "${LAUNCH_ARGS:-}" ]]; then
        read -r -a launch_args <<<"$LAUNCH_ARGS"
    fi
    if [[ ! -f "$config" ]]; then
        echo "error: accelerate config $config does not exist" >&2
        return 2
    fi
    local -a selected=()
    if [[ -n "${STAGES:-}" ]]; then
        local n
        for n in $STAGES; do
            if ! [[ "$n" =~ ^[0-9]+$ ]] || ((n < 1 || n > ${#RECIPES[@]})); then
                echo "error: STAGES entries must be 1..${#RECIPES[@]}, got '$n'" >&2
                return 2
            fi
            selected+=("${RECIPES[n - 1]}")
        done
    else
        selected=("${RECIPES[@]}")
    fi
    local recipe out src data key
    if ((${#selected[@]} > 1)); then
        for key in checkpoint.output_dir model.name_or_path; do
            if [[ -n "$(_stage_override "$key" "$@")" ]]; then
                echo "error: --$key would apply to all ${#selected[@]} stages, but each stage starts from" \
                    "the previous one's output_dir/final: give it for one stage (STAGES=N)" >&2
                return 2
            fi
        done
    fi
    local -a todo=() missing=()
    for recipe in "${selected[@]}"; do
        out=$(_stage_override checkpoint.output_dir "$@")
        [[ -n "$out" ]] || out=$(_stage_yaml_get "$recipe" checkpoint.output_dir)
        [[ -f "$out/final/ringft_recipe.json" ]] && continue
        todo+=("$recipe")
        for key in data.path data.eval_path; do
            data=$(_stage_override "$key" "$@")
            [[ -n "$data" ]] || data=$(_stage_yaml_get "$recipe" "$key")
            if [[ -n "$data" && ! -e "$data" ]]; then
                missing+=("$recipe reads $key $data, which does not exist")
            fi
        done
    done
    if ((${#todo[@]})); then
        src=$(_stage_override model.name_or_path "$@")
        [[ -n "$src" ]] || src=$(_stage_yaml_get "${todo[0]}" model.name_or_path)
        if [[ "$src" == outputs/* && ! -d "$src" ]]; then
            missing+=("${todo[0]} starts from $src, which does not exist: run the previous stage first")
        elif [[ "$src" == models/* || "$src" == /* || "$src" == .* ]] && [[ ! -d "$src" ]]; then
            # a local folder (not a hub name): else it is looked up on the hub, and not found there
            missing+=("${todo[0]} starts from $src, which does not exist: build it first (the recipe's header)")
        fi
    fi
    if ((${#missing[@]})); then
        local line level=error
        dry_run && level=warning
        for line in "${missing[@]}"; do
            echo "$level: $line" >&2
        done
        if ! dry_run; then
            echo "error: nothing launched (build the data first: the recipes' headers)" >&2
            return 1
        fi
    fi
    for recipe in "${selected[@]}"; do
        out=$(_stage_override checkpoint.output_dir "$@")
        [[ -n "$out" ]] || out=$(_stage_yaml_get "$recipe" checkpoint.output_dir)
        src=$(_stage_override model.name_or_path "$@")
        [[ -n "$src" ]] || src=$(_stage_yaml_get "$recipe" model.name_or_path)
        if [[ -f "$out/final/ringft_recipe.json" ]]; then
            echo "== $recipe: $out/final exists, skipping (delete $out to train it again)" >&2
            continue
        fi
        if ! dry_run && [[ "$src" == outputs/* && ! -d "$src" ]]; then
            echo "error: $recipe starts from $src, which does not exist: run the previous stage first" >&2
            return 1
        fi
        echo "== $recipe ($config): $src -> $out/final" >&2
        _stage_exec "${ACCELERATE:-accelerate}" launch --config_file "$config" "${launch_args[@]}" \
            -m ringft train "$recipe" --resume "$@"
    done
}
