"""What the ``accelerate launch`` config means for a recipe run through the Trainer: DeepSpeed's
accumulation and clipping taken from the recipe, the launch's mixed precision, the refusals that
need no model (FSDP without GPUs, bf16 weights without fp32 masters, tiled norms under DeepSpeed),
and ZeRO-3's partitioned construction.

``accelerate launch`` passes a DeepSpeed config's values as ``ACCELERATE_*`` variables, which the
Trainer's ``DeepSpeedPlugin`` reads when it is built: the recipe is the one source of truth for the
batch layout and clipping, so its ``train.grad_accum`` and ``train.grad_clip`` replace the launch
config's ``gradient_accumulation_steps`` and ``gradient_clipping`` there (the micro batch and the
global batch are ``auto``: the Trainer fills them from the ``TrainingArguments``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ringft.train.errors import RecipeError
from ringft.train.recipe import Recipe

__all__ = [
    "check_master_precision",
    "launch_kind",
    "launch_precision",
    "model_construction",
    "prepare_launch",
]


def _launched_with(name: str) -> bool:
    return os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"


def launch_kind() -> str:
    """``deepspeed``, ``fsdp`` or ``ddp`` (plain DDP, or one process), from the launch's variables."""
    return "deepspeed" if _launched_with("DEEPSPEED") else "fsdp" if _launched_with("FSDP") else "ddp"


def launch_precision() -> str:
    """The launch config's ``mixed_precision`` (``no`` when not launched)."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


def check_master_precision(kind: str, mixed_precision: str, recipe: Recipe) -> None:
    """bf16 weights under DeepSpeed / FSDP (``kind``) need the launch's ``mixed_precision: bf16``:
    only then do they keep fp32 master weights (under DDP ringft keeps them itself)."""
    if kind != "ddp" and recipe.model.dtype == "bf16" and mixed_precision != "bf16":
        raise RecipeError(
            f"model.dtype bf16 under {kind} with the launch config's mixed_precision {mixed_precision!r} "
            "trains bf16 weights without fp32 master weights (small updates are lost): set "
            "mixed_precision: bf16 in the launch config, or model.dtype fp32"
        )


def prepare_launch(recipe: Recipe, is_main: bool) -> dict[str, Any]:
    """Check the recipe against the launch and hand the recipe's values to DeepSpeed; returns the
    ``TrainingArguments`` keys the launch decides (``bf16``)."""
    kind, mixed = launch_kind(), launch_precision()
    if kind == "fsdp" and not torch.cuda.is_available():
        raise RecipeError(
            "an FSDP launch config needs GPUs (accelerate runs FSDP only on accelerators; on CPU it "
            "would silently train without sharding): on CPU use recipes/accelerate/cpu_2proc.yaml, "
            "or a DeepSpeed ZeRO-3 config (DeepSpeed's CPU accelerator runs on gloo)"
        )
    if kind == "deepspeed" and recipe.train.tiled_norm_tokens:
        raise RecipeError(
            "train.tiled_norm_tokens is not supported under DeepSpeed: ZeRO-3 gathers a norm's "
            "partitioned weight in hooks of its own forward call, which a tile's recompute bypasses; "
            "drop train.tiled_norm_tokens, or launch with an FSDP or DDP config"
        )
    check_master_precision(kind, mixed, recipe)
    if kind == "deepspeed":
        t = recipe.train
        given = os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "auto")
        if is_main and given != "auto" and t.grad_clip and float(given) != float(t.grad_clip):
            print(
                f"ringft: DeepSpeed config gradient_clipping={given} replaced by the recipe's "
                f"train.grad_clip={t.grad_clip}",
                flush=True,
            )
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(t.grad_accum)
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(float(t.grad_clip or 0.0))
    return {"bf16": mixed == "bf16"}


@contextlib.contextmanager
def model_construction() -> Iterator[None]:
    """Build the model under ``deepspeed.zero.Init`` when the launch config's ``zero3_init_flag``
    asks for it (the Trainer registers DeepSpeed's config with transformers only later, when the
    model exists); otherwise as it is. DDP on CUDA: on the process's GPU."""
    if launch_kind() == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin()  # the launch's, read from its variables (as the Trainer's will be)
        if plugin.is_zero3_init_enabled():
            plugin.set_deepspeed_weakref()  # transformers builds under zero.Init while it lives
        yield
        return
    if launch_kind() == "ddp" and torch.cuda.is_available():
        with torch.device("cuda", torch.cuda.current_device()):
            yield
        return
    yield
