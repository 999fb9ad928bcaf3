"""What differs between DDP, DeepSpeed and FSDP launches: the Accelerator, the DeepSpeed config, how
the model is constructed, and how the micro-steps of one optimizer step reduce their gradients.

Gradient reduction per micro-step (``run_micro_steps``):

- DDP: ``no_sync`` on every micro-step but the last (gradients accumulate locally; one all-reduce);
- FSDP: *no* ``no_sync``: gradients are reduce-scattered on every micro-step, so each rank only ever
  holds its gradient shard (``no_sync`` would keep full unsharded gradients until the last
  micro-step: for 8B parameters ~15 GiB per rank in bf16);
- DeepSpeed: the engine reduces (ZeRO: reduce-scatters) every micro-step and is told the boundary;
  it divides the loss by its ``gradient_accumulation_steps`` (= ``train.grad_accum``), clips and
  steps at the boundary.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ringft.loss.module import CausalLMLoss
from ringft.loss.normalization import LossNormalization
from ringft.train.errors import RecipeError
from ringft.train.front_launch import check_master_precision
from ringft.train.hf.precision import configure_fsdp_precision
from ringft.train.recipe import Recipe

__all__ = [
    "DDP",
    "DEEPSPEED",
    "FSDP",
    "check_precision",
    "configure_deepspeed",
    "configure_fsdp_precision",
    "distributed_kind",
    "make_accelerator",
    "micro_step_context",
    "model_construction",
    "run_micro_steps",
]

DDP, DEEPSPEED, FSDP = "ddp", "deepspeed", "fsdp"


def _launched_with(name: str) -> bool:
    """``accelerate launch`` with a DeepSpeed / FSDP config sets ``ACCELERATE_USE_<NAME>=true``."""
    return os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"


def make_accelerator(recipe: Recipe) -> Any:
    """The ``Accelerator`` for this launch (gloo on CPU; DeepSpeed's CPU accelerator without GPUs).

    Raises :class:`RecipeError` (on every rank, before any collective) for an FSDP launch without GPUs
    and for ``train.tiled_norm_tokens`` under DeepSpeed.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    out = recipe.checkpoint.output_dir
    tracker = recipe.logging.tracker
    tracker = None if tracker in (None, "none") else tracker
    handlers = []
    cpu = not torch.cuda.is_available()
    if cpu and _launched_with("FSDP"):
        raise RecipeError(
            "an FSDP launch config needs GPUs (accelerate runs FSDP only on accelerators; on CPU it "
            "would silently train without sharding): on CPU use recipes/accelerate/cpu_2proc.yaml, "
            "or a DeepSpeed ZeRO-3 config (DeepSpeed's CPU accelerator runs on gloo)"
        )
    if recipe.train.tiled_norm_tokens and _launched_with("DEEPSPEED"):
        raise RecipeError(
            "train.tiled_norm_tokens is not supported under DeepSpeed: ZeRO-3 gathers a norm's "
            "partitioned weight in hooks of its own forward call, which a tile's recompute bypasses; "
            "drop train.tiled_norm_tokens, or launch with an FSDP or DDP config"
        )
    if cpu and _launched_with("DEEPSPEED"):
        # accelerate's cpu=True would silently drop DeepSpeed, and cpu=False finds no backend
        # unless one is named.
        cpu = False
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(
        cpu=cpu,  # without a GPU: gloo on CPU (accelerate's MULTI_CPU)
        kwargs_handlers=handlers,
        log_with=tracker,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=f"{out}/logs"),
    )


def distributed_kind(accelerator: Any) -> str:
    """:data:`DEEPSPEED`, :data:`FSDP` or :data:`DDP` (plain DDP, or one process)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return DEEPSPEED
    if accelerator.distributed_type == DistributedType.FSDP:
        return FSDP
    return DDP


def check_precision(kind: str, accelerator: Any, recipe: Recipe) -> None:
    """bf16 weights under DeepSpeed / FSDP need the launch's ``mixed_precision: bf16``: only then do
    they keep fp32 master weights (under DDP ringft keeps them itself, ``master_weights.py``)."""
    check_master_precision(kind, accelerator.mixed_precision, recipe)


def configure_deepspeed(accelerator: Any, recipe: Recipe, world: int) -> None:
    """Fill the DeepSpeed config from the recipe before ``prepare`` (which has no dataloader here).

    The recipe is the one source of truth for the batch layout and clipping: DeepSpeed's micro batch
    = ``train.micro_batch_size``, its gradient accumulation = ``train.grad_accum`` (the trainer
    feeds the micro-steps and marks the boundary), clipping = ``train.grad_clip``. Its
    ``train_batch_size`` counts every rank (DeepSpeed sees dp x cp ranks as data parallel; the CP
    ranks of a replica share examples, so that is ``cp`` times the examples actually consumed).
    """
    plugin = accelerator.state.deepspeed_plugin
    cfg = plugin.deepspeed_config
    t = recipe.train
    given = cfg.get("gradient_clipping")
    if given not in (None, "auto") and t.grad_clip and float(given) != float(t.grad_clip):
        accelerator.print(
            f"ringft: DeepSpeed config gradient_clipping={given} replaced by the recipe's "
            f"train.grad_clip={t.grad_clip}"
        )
    cfg["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    cfg["gradient_accumulation_steps"] = t.grad_accum
    cfg["train_batch_size"] = t.micro_batch_size * t.grad_accum * world
    cfg["gradient_clipping"] = float(t.grad_clip or 0.0)
    accelerator.gradient_accumulation_steps = t.grad_accum


@contextlib.contextmanager
def model_construction(accelerator: Any, kind: str) -> Iterator[None]:
    """Build the model under ``deepspeed.zero.Init`` only when the launch config's ``zero3_init_flag``
    asks for it. (accelerate registers the ZeRO-3 config with transformers whatever the flag, so
    transformers would partition at construction anyway.) Without it every rank builds the full model
    and the engine partitions it. DDP on CUDA: the model is built on the process's GPU (random
    initialisation of a model from config runs there: minutes faster than on the CPU for 8B)."""
    if kind == DDP and accelerator.device.type == "cuda":
        with torch.device(accelerator.device):
            yield
        return
    if kind != DEEPSPEED:
        yield
        return
    plugin = accelerator.state.deepspeed_plugin
    if plugin.is_zero3_init_enabled():
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # (local state only: no collective)


def micro_step_context(module: nn.Module, kind: str, last: bool) -> contextlib.AbstractContextManager:
    """DDP: the module's ``no_sync`` on all micro-steps but the last; FSDP, DeepSpeed: nothing."""
    if kind == DDP and not last and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


def _loss_module(module: nn.Module) -> CausalLMLoss:
    """The :class:`CausalLMLoss` inside ``module`` (itself, or under DDP / FSDP / a DeepSpeed engine)."""
    found = next((m for m in module.modules() if isinstance(m, CausalLMLoss)), None)
    if found is None:
        raise TypeError(
            f"run_micro_steps needs a (wrapped) ringft.loss.CausalLMLoss, got {type(module).__name__}"
        )
    return found


def run_micro_steps(
    module: nn.Module,
    batches: Sequence[dict[str, Tensor]],
    norm: LossNormalization,
    kind: str,
    backward: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """Forward + backward of every micro-step of one optimizer step.

    ``module(input_ids, position_ids, shift_labels, num_items_in_batch, cu_seqlens, loss_scale)`` returns
    the scaled loss share (:class:`ringft.loss.CausalLMLoss`, possibly wrapped by DDP / FSDP / a
    DeepSpeed engine); ``batches`` hold ``(batch, seq_local)`` tensors; ``norm`` is the step's
    :func:`ringft.loss.loss_normalization`. ``backward(loss)`` runs the backward (DDP / FSDP;
    default ``loss.backward()``); a DeepSpeed engine's own backward is used for :data:`DEEPSPEED`.

    The scale is applied inside the module, in fp32, and the logged shares are its fp32
    ``last_loss``: a wrapper's output cast (FSDP2's ``output_dtype=bf16``) changes neither.

    Returns the sum of this rank's loss shares (fp32 0-d tensor, detached): summed over the world it
    is the step's mean token loss.
    """
    backward = backward or (lambda loss: loss.backward())
    inner = _loss_module(module)
    # DeepSpeed divides the loss by its gradient_accumulation_steps (= len(batches)): undone here.
    scale = norm.loss_scale * (len(batches) if kind == DEEPSPEED else 1)
    total = torch.zeros((), dtype=torch.float32, device=norm.num_items_in_batch.device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with micro_step_context(module, kind, last):
            loss = module(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                shift_labels=batch["shift_labels"],
                num_items_in_batch=norm.num_items_in_batch,
                cu_seqlens=batch.get("cu_seqlens"),
                loss_scale=scale,
            )
            if kind == DEEPSPEED:
                module.set_gradient_accumulation_boundary(is_boundary=last)
                module.backward(loss)
            else:
                backward(loss)
        total += inner.last_loss.float()
    return total
