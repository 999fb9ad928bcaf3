"""``ringft plan``: the layout table, the recommended plan, the longest sequence that fits, and, when
nothing fits, the flags that would make it fit."""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from functools import partial
from typing import Any

from ringft.ops.backends import BACKENDS
from ringft.ops.sharding import zigzag_length_problem, zigzag_padded_length
from ringft.planner.capacity import capacity_main
from ringft.planner.recipe_out import recipe_text, write_recipe
from ringft.planner.report import format_layouts, format_plan
from ringft.planner.search import Fix, fixes_that_fit, max_seq_len_that_fits, plan_layouts, recommend
from ringft.planner.setup import ATTENTION_CHECKPOINTS, ATTN_BACKENDS, GIB, PLANNED_DTYPES, divisors
from ringft.planner.shapes import DEFAULT_LORA_TARGETS, PRESETS, load_model_shape
from ringft.planner.timing_report import add_time_arguments, hardware_from_args, time_section
from ringft.utils import values
from ringft.utils.options import add_option

__all__ = ["plan_main"]

# TrainingSetup field -> the parser's dest, for the options a fix may change.
_FIX_DESTS = {
    "zero_stage": "zero",
    "micro_batch_size": "micro_batch_size",
    "chunked_loss": "chunked_loss",
    "gradient_checkpointing": "gradient_checkpointing",
    "tiled_mlp": "tiled_mlp",
    "offload_activations": "offload_activations",
    "offload_optimizer": "offload_optimizer",
    "offload_params": "offload_params",
    "lora": "lora",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringft plan",
        description="Per-rank GPU memory plan for long-context fine-tuning with zigzag ring attention.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), model directory or hub name")
    src.add_argument("--config-json", help="path to a transformers config.json")
    p.add_argument(
        "--seq-len",
        type=values.tokens_arg,
        required=True,
        help="global sequence length S in tokens (128k = 131072)",
    )
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (dp * cp)")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GiB")
    add_option(p, "cp_size", append=True, note="repeat to compare sizes (default: every divisor of --gpus)")
    add_option(p, "ulysses_size", default=1, note="the memory plan of this Ulysses x ring split")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-step")
    p.add_argument("--lora", action="store_true", help="LoRA instead of full fine-tuning")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--lora-targets",
        default=None,
        help=f"default: {','.join(DEFAULT_LORA_TARGETS)} (latent attention: its projections and o_proj)",
    )
    p.add_argument(
        "--lora-bf16-adapters",
        action="store_true",
        help="adapters in the model dtype (recipe lora.adapter_dtype: model; peft "
        "autocast_adapter_dtype=False); default fp32 adapters",
    )
    p.add_argument("--dtype", choices=PLANNED_DTYPES, default="bf16")
    p.add_argument("--no-master-weights", action="store_true", help="pure bf16 (no fp32 master copy)")
    p.add_argument(
        "--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (FSDP FULL_SHARD: 3)"
    )
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload")
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=True)
    add_option(p, "loss_chunk_size", default=4096)
    p.add_argument("--tiled-mlp", action="store_true", help="MLP in tiles of hidden-size tokens")
    add_option(p, "tiled_mlp_tokens", note="implies --tiled-mlp")
    add_option(p, "tiled_norm_tokens")
    p.add_argument(
        "--fused-rmsnorm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the RMSNorms' fused backward (recipe train.fused_rmsnorm, default on)",
    )
    add_option(p, "attention_tile_tokens")
    add_option(p, "attention_checkpoint", default="recompute", choices=ATTENTION_CHECKPOINTS)
    add_option(
        p,
        "attn_backend",
        default="flash_attn",
        choices=BACKENDS,
        note="auto is planned as its choice on Hopper (cudnn); cudnn / reference as torch (K/V expanded)",
    )
    p.add_argument("--overhead-gib", type=float, default=3.0, help="CUDA context, NCCL buffers, ...")
    p.add_argument("--explore-offload", action="store_true", help="also try every offload combination")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--recipe", action="store_true", help="print the recommended plan as a training recipe")
    p.add_argument("--write-recipe", metavar="PATH", help="write the recommended plan as a recipe YAML")
    p.add_argument("--force", action="store_true", help="let --write-recipe overwrite an existing file")
    p.add_argument("--rope-theta", type=float, help="model.rope_theta of the written recipe (memory: none)")
    add_time_arguments(p)
    p.add_argument(
        "--capacity-table",
        action="store_true",
        help="print the longest trainable sequence of Llama-3.2-1B / Llama-3-8B shapes per option set, "
        "on 1 GPU and on 8 (takes only --gpu-mem, default 79.6, and --out FILE to append it)",
    )
    return p


def _argument_problems(args: argparse.Namespace) -> list[str]:
    """One message per bad numeric argument, naming its value and the fix."""
    counts = [
        ("--micro-batch-size", args.micro_batch_size),
        ("--lora-rank", args.lora_rank),
        ("--loss-chunk-size", args.loss_chunk_size),
        ("--tiled-mlp-tokens", args.tiled_mlp_tokens),
        ("--tiled-norm-tokens", args.tiled_norm_tokens),
        ("--attention-tile-tokens", args.attention_tile_tokens),
        ("--ulysses-size", args.ulysses_size),
    ]
    out = values.problems(
        partial(values.as_integer, "--seq-len", args.seq_len, 2, fix=SEQ_LEN_FIX),
        partial(values.as_integer, "--gpus", args.gpus, 1, fix=GPUS_FIX),
        partial(values.as_number, "--gpu-mem", args.gpu_mem, gt=0, fix=GPU_MEM_FIX),
        *(partial(values.as_integer, flag, value, 1) for flag, value in counts if value is not None),
        partial(values.as_number, "--overhead-gib", args.overhead_gib, 0, fix="must be >= 0 GiB"),
    )
    u = args.ulysses_size
    if u >= 1 and args.gpus >= 1 and args.gpus % u:
        out.append(f"--ulysses-size {u} does not divide --gpus {args.gpus}: use one of {divisors(args.gpus)}")
    for cp in args.cp_size or []:
        if u >= 1 and cp >= 1 and cp % u:
            out.append(f"--ulysses-size {u} does not divide --cp-size {cp}: use one of {divisors(cp)}")
        if cp < 1:
            out += values.problems(partial(values.as_integer, "--cp-size", cp, 1))
        elif args.gpus >= 1 and args.gpus % cp:
            out.append(f"--cp-size {cp} does not divide --gpus {args.gpus}: use one of {divisors(args.gpus)}")
        elif args.seq_len >= 2:
            length = zigzag_length_problem(args.seq_len, cp, f"--seq-len {args.seq_len} (--cp-size {cp})")
            out += [length] if length else []
    if (
        not out
        and not args.cp_size
        and all(zigzag_length_problem(args.seq_len, c) for c in divisors(args.gpus))
    ):
        out.append(
            f"--seq-len {args.seq_len} is not a multiple of 2 x cp for any CP size dividing --gpus "
            f"{args.gpus} (zigzag cuts a sequence into 2 x cp chunks): use e.g. "
            f"{zigzag_padded_length(args.seq_len, args.gpus)}"
        )
    return out


# The memory model knows flash_attn (GQA-native) and torch (K/V heads expanded); auto runs cudnn on
# Hopper, and cudnn expands K/V where its build has no native GQA: planned as torch.
_PLANNED_BACKEND = {name: "torch" for name in BACKENDS if name not in ATTN_BACKENDS}

SEQ_LEN_FIX = "give the global sequence length in tokens, >= 2 (e.g. 65536)"
GPUS_FIX = "give the number of GPUs of the job, >= 1 (e.g. 8)"
GPU_MEM_FIX = "give the memory of one GPU in GiB, > 0 (e.g. 79.6)"


def _options(args: argparse.Namespace, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> dict[str, Any]:
    """The :class:`TrainingSetup` options of ``args``; ``targets``: the model's LoRA targets when
    ``--lora-targets`` is not given."""
    if args.lora_targets is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    options: dict[str, Any] = {
        "micro_batch_size": args.micro_batch_size,
        "lora": args.lora,
        "lora_rank": args.lora_rank,
        "lora_targets": targets,
        "lora_fp32_adapters": not args.lora_bf16_adapters,
        "dtype": args.dtype,
        "master_weights": not args.no_master_weights,
        "zero_stage": args.zero,
        "offload_optimizer": args.offload_optimizer,
        "offload_params": args.offload_params,
        "offload_activations": args.offload_activations,
        "gradient_checkpointing": args.gradient_checkpointing,
        "chunked_loss": args.chunked_loss,
        "loss_chunk_size": args.loss_chunk_size,
        "tiled_mlp": args.tiled_mlp or args.tiled_mlp_tokens is not None,
        "tiled_mlp_tokens": args.tiled_mlp_tokens,
        "tiled_norm_tokens": args.tiled_norm_tokens,
        "fused_rmsnorm": args.fused_rmsnorm,
        "attention_tile_tokens": args.attention_tile_tokens,
        "attention_checkpoint": args.attention_checkpoint,
        "attn_backend": _PLANNED_BACKEND.get(args.attn_backend, args.attn_backend),
        "overhead_gib": args.overhead_gib,
        "ulysses_size": args.ulysses_size,
    }
    if args.explore_offload:
        for k in ("offload_optimizer", "offload_params", "offload_activations"):
            options.pop(k)
    return options


def _words(action: argparse.Action, value: Any) -> list[str]:
    """Command-line words that set ``action`` to ``value``."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001 - no public class for store_true
        return [flag] if value else []
    if isinstance(value, list):
        return [w for item in value for w in (flag, str(item))]
    return [flag, f"{value:g}" if isinstance(value, float) else str(value)]


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``args`` as a ``ringft plan`` command line (only the options that differ from the defaults)."""
    words = ["ringft", "plan"]
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its options
        if not action.option_strings or action.dest in ("help", "json", "recipe", "force"):
            continue
        value = getattr(args, action.dest)
        if value is not None and value != action.default:
            words += _words(action, value)
    return shlex.join(words)


def _fix_args(args: argparse.Namespace, fix: Fix) -> argparse.Namespace:
    fixed = copy.copy(args)
    for key, value in fix.changes.items():
        setattr(fixed, _FIX_DESTS[key], value)
    return fixed


def _fix_flags(parser: argparse.ArgumentParser, fix: Fix) -> list[str]:
    """The command-line words of the changes of ``fix``, e.g. ``["--zero", "3", "--chunked-loss"]``."""
    by_dest = {a.dest: a for a in parser._actions}  # noqa: SLF001
    return [w for key, value in fix.changes.items() for w in _words(by_dest[_FIX_DESTS[key]], value)]


def _explain_fixes(parser: argparse.ArgumentParser, args: argparse.Namespace, fixes: list[Fix]) -> str:
    if not fixes:
        return (
            "nothing fits, not even with ZeRO-3, every offload, tiling, chunked loss and LoRA: use more "
            "or larger GPUs, or a shorter --seq-len"
        )
    lines = ["nothing fits with these options. Flags that make it fit (cheapest first):"]
    for fix in fixes:
        p = fix.plan
        flags = " ".join(_fix_flags(parser, fix))
        lines.append(
            f"  {flags:<40} -> cp {p.setup.cp_size} x dp {p.setup.dp_size}: {p.total / GIB:.1f} of "
            f"{p.setup.gpu_mem_gib:g} GiB per GPU"
        )
    lines.append("e.g. " + _command(parser, _fix_args(args, fixes[0])))
    return "\n".join(lines)


def plan_main(argv: list[str] | None = None) -> int:
    """``ringft plan ...``: print the layout table, the recommended plan and the longest sequence
    that fits; when nothing fits, the cheapest flags that would make it fit. Returns 0 when some
    layout fits, 1 when none does, 2 on bad arguments (one line naming each bad value and the fix).
    """
    argv = sys.argv[1:] if argv is None else argv
    if "--capacity-table" in argv:
        return capacity_main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    problems = _argument_problems(args)
    if problems:
        print("ringft plan: error: " + "; ".join(problems))
        return 2
    try:
        hardware_from_args(args)
        shape = load_model_shape(args.config_json or args.model)
        options = _options(args, shape.default_lora_targets)
        layout = dict(cp_sizes=args.cp_size, **options)
        plans = plan_layouts(
            shape, args.seq_len, args.gpus, args.gpu_mem, explore_offload=args.explore_offload, **layout
        )
    except (ValueError, TypeError) as exc:
        print(f"ringft plan: error: {exc}")
        return 2
    best = recommend(plans)
    if args.recipe or args.write_recipe:
        return _recipe(parser, args, best, shape)
    fixes = [] if best else fixes_that_fit(shape, args.seq_len, args.gpus, args.gpu_mem, **layout)
    shown = best or min(plans, key=lambda p: p.total)
    cps = args.cp_size or [shown.setup.cp_size]
    times = time_section(shape, args.seq_len, args.gpus, cps, args) if args.time else None
    if args.json:
        data = {"plans": [p.as_dict() for p in plans], "recommended": best.as_dict() if best else None}
        if times:
            data["step_times"] = times[1]
        if not best:
            data["fixes"] = [
                {"flags": _fix_flags(parser, f), "changes": f.changes, "plan": f.plan.as_dict()}
                for f in fixes
            ]
        print(json.dumps(data))
        return 0 if best else 1
    print(format_layouts(plans))
    print()
    print(("recommended layout:" if best else "nothing fits; the smallest plan:") + "\n")
    print(format_plan(shown))
    s = shown.setup
    offloads = {k: getattr(s, k) for k in ("offload_optimizer", "offload_params", "offload_activations")}
    longest = max_seq_len_that_fits(
        shape, s.num_gpus, s.gpu_mem_gib, cp_size=s.cp_size, **{**options, **offloads}
    )
    print(f"\nlongest sequence that fits this layout (multiples of {2 * s.cp_size * 1024}): {longest}")
    if not best:
        print("\n" + _explain_fixes(parser, args, fixes))
    if times:
        print("\n" + times[0])
    return 0 if best else 1


def _recipe(parser: argparse.ArgumentParser, args: argparse.Namespace, best, shape) -> int:
    """``--recipe`` / ``--write-recipe``: the recommended plan as a recipe (exit 1 when nothing fits)."""
    if best is None:
        print(
            "ringft plan: error: nothing fits, so there is no recipe to write: run without --recipe / "
            "--write-recipe to see the flags that would make it fit"
        )
        return 1
    path = args.write_recipe or "recipe.yaml"
    text = recipe_text(args, best, shape.name, _command(parser, args), path)
    if not args.write_recipe:
        print(text, end="")
        return 0
    problem = write_recipe(text, args.write_recipe, args.force)
    if problem:
        print(f"ringft plan: error: {problem}")
        return 2
    print(
        f"wrote {args.write_recipe}: cp {best.setup.cp_size} x dp {best.setup.dp_size}, "
        f"{best.total / GIB:.1f} GiB per GPU; {text.splitlines()[3][2:]}"
    )
    return 0
