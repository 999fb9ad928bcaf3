"""What a ring trainer refuses when it is built (on every rank: the checks read only local,
identical settings), each with the fix in one line."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

__all__ = [
    "attention_checkpoint_problem",
    "check_no_accelerate_cp",
    "check_tiled_norm",
    "check_trainer_options",
    "scoring_problems",
]

WHERE = "ringft.RingTrainerMixin"


def _cp_or_sp(config: Any) -> list[str]:
    if config is None:
        return []
    return [f"{n}={getattr(config, n)}" for n in ("cp_size", "sp_size") if (getattr(config, n, 1) or 1) > 1]


def check_no_accelerate_cp(args: Any) -> None:
    """Refuse a ``parallelism_config`` with context or sequence parallelism: the ring replaces it."""
    found = _cp_or_sp(getattr(args, "parallelism_config", None))
    if found:
        raise ValueError(
            f"{WHERE}: TrainingArguments.parallelism_config has {', '.join(found)}; ringft's cp_size "
            "replaces accelerate's context / sequence parallelism: drop them from the parallelism_config and "
            "pass cp_size=... to the trainer"
        )


def attention_checkpoint_problem(value: Any, args: Any) -> str | None:
    """Why ``attention_checkpoint=value`` cannot run with these ``TrainingArguments`` (or None)."""
    from ringft.model.attention_checkpoint import ATTENTION_CHECKPOINT
    from ringft.utils.values import BadValue, as_choice

    try:
        as_choice("attention_checkpoint", value, ATTENTION_CHECKPOINT)
    except BadValue as exc:
        return str(exc)
    if value != "recompute" and args is not None and not getattr(args, "activation_checkpointing", False):
        return (
            f"attention_checkpoint={value!r} keeps what activation checkpointing would recompute, but the "
            "TrainingArguments have activation_checkpointing off (nothing is recomputed): set "
            "activation_checkpointing=True or attention_checkpoint='recompute'"
        )
    return None


def _fsdp_requested(args: Any) -> bool:
    return (
        bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    )


def check_trainer_options(trainer: Any) -> None:
    """Raise ``ValueError`` for a setting the ring trainer cannot run exactly."""
    args = trainer.args
    found = _cp_or_sp(getattr(trainer.accelerator, "parallelism_config", None))
    problems = []
    if found:
        problems.append(
            f"the accelerate launch config sets {', '.join(found)}: remove its parallelism_config and pass "
            "cp_size"
        )
    if trainer.compute_loss_func is not None or getattr(args, "label_smoothing_factor", 0):
        problems.append(
            "compute_loss_func / label_smoothing_factor need the full logits, which the ring trainer never "
            "builds (chunked loss): drop them"
        )
    if not getattr(trainer, "_ring_keeps_trl_loss", False) and getattr(args, "loss_type", "nll") not in (
        "nll",
        None,
    ):
        problems.append(
            f"SFTConfig.loss_type={args.loss_type!r}: the ring trainer computes the plain NLL ('nll')"
        )
    if getattr(args, "use_liger_kernel", False):
        problems.append("use_liger_kernel replaces the model's forward and loss: turn it off")
    if getattr(args, "torch_compile", False):
        problems.append("torch_compile is not supported with the ring: turn it off")
    if getattr(args, "n_gpu", 1) > 1:
        problems.append("one process drives several GPUs (DataParallel): launch one process per GPU")
    if "inputs" in (getattr(args, "include_for_metrics", None) or []):
        problems.append(
            "include_for_metrics='inputs' would hand the metrics a CP rank's shard: drop 'inputs'"
        )
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        problems.append("train_sampling_strategy='batch_rebalance' shards over every process: use 'random'")
    acc_config = getattr(args, "accelerator_config", None)
    if getattr(acc_config, "dispatch_batches", None) or getattr(acc_config, "split_batches", False):
        problems.append("accelerator_config dispatch_batches / split_batches: leave them off")
    if _fsdp_requested(args) and not trainer.is_fsdp_enabled:
        problems.append(
            "FSDP was asked for but accelerate did not enable it (accelerate runs FSDP only on accelerators; "
            "on CPU it would train unsharded): use DDP or DeepSpeed ZeRO-3 on CPU"
        )
    launched = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if trainer.accelerator.num_processes != launched:
        problems.append(
            f"accelerate runs {trainer.accelerator.num_processes} process(es) but {launched} were launched "
            "(accelerate then trains each process alone): on CPU pass use_cpu=True in the TrainingArguments"
        )
    if problems:
        raise ValueError(f"{WHERE}: " + "; ".join(problems))


def check_tiled_norm(trainer: Any) -> None:
    """Refuse ``tiled_norm_tokens`` under DeepSpeed (ZeRO-3 gathers a norm's partitioned weight in
    hooks of its own forward call, which a tile's recompute bypasses)."""
    if trainer.is_deepspeed_enabled:
        raise ValueError(
            f"{WHERE}: tiled_norm_tokens is not supported under DeepSpeed: ZeRO-3 gathers a norm's "
            "partitioned weight in hooks of its own forward call, which a tile's recompute bypasses; drop "
            "it, or launch with an FSDP or DDP config"
        )


def scoring_problems(trainer: Any) -> list[str]:
    """What TRL's sequence-scoring trainers (DPO, GRPO) refuse alike on the ring: TRL's router
    auxiliary loss (not computed on the ring) and prompt-learning PEFT (virtual tokens on
    every shard)."""
    problems = []
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append(
            "the MoE router auxiliary loss is not computed on the ring: set router_aux_loss_coef=0"
        )
    peft_config = getattr(trainer.model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        problems.append("prompt-learning PEFT prepends virtual tokens to every shard: use LoRA")
    return problems
