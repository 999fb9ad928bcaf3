"""``ringft plan --recipe`` / ``--write-recipe PATH``: the recommended plan as a training recipe.

The recipe carries the layout (``parallel.cp_size``; dp is the launched processes / cp), the
training options the plan assumed (gradient checkpointing, activation offload, tiled MLP / norms,
the chunked loss, LoRA, dtype, attention backend) and the sequence length; header comments name
the accelerate launch config for the plan's sharding / offload and the launch command. What the
planner cannot know is left for the user, marked ``CHANGE-ME`` (the packed data folder).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import yaml

from ringft.planner.setup import MemoryPlan

__all__ = ["HUB_NAMES", "launch_config", "recipe_text", "write_recipe"]

#: The hub repository of each planner preset (the model a recipe loads).
HUB_NAMES = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "gemma-3-4b": "google/gemma-3-4b-pt",
    "gemma-3-12b": "google/gemma-3-12b-pt",
}

ACCELERATE = "recipes/accelerate"


def launch_config(plan: MemoryPlan) -> tuple[str, str]:
    """``(config path, note)``: the shipped accelerate config for the plan's sharding and offload."""
    s = plan.setup
    nodes = "" if s.num_gpus <= 8 else f"; {s.num_gpus} GPUs: set num_machines / num_processes"
    if s.zero_stage == 3 and (s.offload_optimizer or s.offload_params):
        return f"{ACCELERATE}/deepspeed_zero3_offload.yaml", "DeepSpeed ZeRO-3, CPU offload" + nodes
    if s.zero_stage == 3:
        return f"{ACCELERATE}/deepspeed_zero3.yaml", "DeepSpeed ZeRO-3; or fsdp2.yaml" + nodes
    if s.zero_stage in (1, 2):
        return (
            f"{ACCELERATE}/deepspeed_zero3.yaml",
            f"DeepSpeed: set zero_stage: {s.zero_stage} in a copy" + nodes,
        )
    if s.num_gpus > 8:
        return f"{ACCELERATE}/2node_8gpu.yaml", f"DDP over nodes{nodes}"
    return f"{ACCELERATE}/1node_8gpu.yaml", "DDP"


def _model_name(model: str | None, shape_name: str) -> str:
    if model is None:  # --config-json: the model folder is the JSON file's folder, if that is one
        return "CHANGE-ME/model-folder-or-hub-name"
    return HUB_NAMES.get(shape_name, model)


def recipe_data(args: argparse.Namespace, plan: MemoryPlan, shape_name: str) -> dict[str, Any]:
    """The recipe sections (plain data) for ``plan``, made with the planner's options ``args``."""
    s = plan.setup
    backend = args.attn_backend
    model: dict[str, Any] = {
        "name_or_path": _model_name(args.model, shape_name),
        "dtype": s.dtype,
        "attn_backend": backend,
    }
    if getattr(args, "rope_theta", None):
        model["rope_theta"] = args.rope_theta
    train: dict[str, Any] = {
        "micro_batch_size": s.micro_batch_size,
        "gradient_checkpointing": s.gradient_checkpointing,
        "offload_activations": s.offload_activations,
        "chunked_loss": s.chunked_loss,
        "loss_chunk_size": s.loss_chunk_size,
    }
    if s.tiled_mlp:
        train["tiled_mlp_tokens"] = s.tiled_mlp_tokens or plan_hidden(plan)
    if s.tiled_norm_tokens:
        train["tiled_norm_tokens"] = s.tiled_norm_tokens
    out: dict[str, Any] = {
        "model": model,
        "data": {"path": "CHANGE-ME/packed-data", "seq_len": s.seq_len},
        "parallel": {"cp_size": s.cp_size},
        "train": train,
    }
    if s.ulysses_size > 1:
        out["parallel"]["ulysses_size"] = s.ulysses_size
    if s.lora:
        out["lora"] = {
            "r": s.lora_rank,
            "target_modules": list(s.lora_targets),
            "adapter_dtype": "fp32" if s.lora_fp32_adapters else "model",
        }
    tag = shape_name.split("/")[-1].lower()
    out["checkpoint"] = {"output_dir": f"outputs/{tag}-{s.seq_len // 1024}k"}
    return out


def plan_hidden(plan: MemoryPlan) -> int:
    """The tile the planner assumes for ``--tiled-mlp`` without a size: the hidden size."""
    return int(plan.model.hidden)


def recipe_text(args: argparse.Namespace, plan: MemoryPlan, shape_name: str, command: str, path: str) -> str:
    """The recipe YAML with its header comments (the plan, the launch config, what to edit)."""
    s = plan.setup
    config, note = launch_config(plan)
    gib = plan.total / 2**30
    launch = f"accelerate launch --config_file {config} --num_processes {s.num_gpus} -m ringft train {path}"
    header = [
        f"# Written by: {command}",
        f"# Plan: cp {s.cp_size} x dp {s.dp_size} on {s.num_gpus} GPUs, {gib:.1f} of {s.gpu_mem_gib:g} GiB "
        "per GPU (planned)",
        f"# Launch config: {config} ({note})",
        f"# Launch: {launch}",
        "# Edit: data.path (data_prep/pack.py --seq-len "
        f"{s.seq_len} --output DIR), train.max_steps / lr, and the RoPE (docs/own-model.md)",
    ]
    body = yaml.safe_dump(recipe_data(args, plan, shape_name), sort_keys=False, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def write_recipe(text: str, path: str, force: bool) -> str | None:
    """Write ``text`` to ``path``; the refusal message when it exists (without ``force``)."""
    target = Path(path)
    if target.is_dir():
        example = shlex.quote(str(target / "recipe.yaml"))
        return f"--write-recipe {path} is a folder: give a file name, e.g. {example}"
    if target.exists() and not force:
        return f"--write-recipe {path} exists: pass --force to overwrite it, or choose another file"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return None
