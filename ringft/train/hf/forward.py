"""The model call of a ring trainer: ringft's chunked loss *through* DDP / DeepSpeed / FSDP.

The chunked loss (``ringft.loss.causal_lm_loss``: decoder -> ``lm_head`` in token chunks, never
the full ``(tokens, vocab)`` logits) must run inside the wrapped model's forward, so that DDP's
reducer, ZeRO-3's parameter gathering and FSDP's unsharding see one ordinary forward.
:func:`install_ring_loss_forward` therefore gives the causal LM (under its peft wrapper, if any) a
forward that takes one more keyword: ``model(..., ringft_loss=True)`` returns
``CausalLMOutputWithPast(loss=sum of this rank's token losses / num_items_in_batch)``; without it
the forward is the previous one (generation, TRL's own fused head, ``predict``'s logits). The
wrapper keeps the model's signature (``Trainer`` reads the column names from it) and binds to the
instance, so a deep copy of the model binds to the copy.

:func:`eval_loss_sum` and :func:`predict_logits` are the no-grad model calls of ``evaluate`` and
``predict``.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringft.loss import causal_lm_loss
from ringft.model.inputs import OFFSETS
from ringft.model.unwrap import pretrained_model
from ringft.ops.cp_sharding import cp_gather
from ringft.ops.parallel import ParallelLayout

__all__ = [
    "RING_LOSS",
    "eval_loss_sum",
    "install_ring_loss_forward",
    "predict_logits",
    "remove_ring_loss_forward",
    "ring_loss",
]

RING_LOSS = "ringft_loss"
IGNORE_INDEX = -100


def _offsets(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's per-row global document offsets, as the ring's decoder keyword (if any)."""
    return {} if batch.get(OFFSETS) is None else {OFFSETS: batch[OFFSETS]}


@dataclass
class _LossSettings:
    chunk_size: int
    offload_activations: bool


def install_ring_loss_forward(model: torch.nn.Module, chunk_size: int, offload_activations: bool) -> None:
    """Give ``model``'s causal LM the ``ringft_loss=True`` forward (idempotent: a second call
    updates the settings). ``offload_activations`` keeps the decoder's saved activations in CPU
    memory (``torch.autograd.graph.save_on_cpu``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm = pretrained_model(model)
    settings = _LossSettings(chunk_size, offload_activations)
    if getattr(lm, "_ringft_loss_settings", None) is not None:
        lm._ringft_loss_settings = settings
        return

    @functools.wraps(type(lm).forward)
    def ring_forward(self, *args: Any, ringft_loss: bool = False, **kwargs: Any) -> Any:
        if not ringft_loss:
            return self._ringft_previous_forward(*args, **kwargs)
        s = self._ringft_loss_settings
        loss = causal_lm_loss(
            self,
            kwargs["input_ids"],
            kwargs["position_ids"],
            kwargs["shift_labels"],
            kwargs["num_items_in_batch"],
            cu_seqlens=kwargs.get(OFFSETS),
            chunked=True,
            chunk_size=s.chunk_size,
            offload_activations=s.offload_activations,
        )
        return CausalLMOutputWithPast(loss=loss)

    lm._ringft_previous_forward = lm.forward  # the class's, or an earlier wrapper (TRL's fused head)
    lm._ringft_loss_settings = settings
    lm.forward = types.MethodType(ring_forward, lm)


def remove_ring_loss_forward(model: torch.nn.Module) -> None:
    """Undo :func:`install_ring_loss_forward` (a no-op when it was not installed)."""
    lm = pretrained_model(model)
    if getattr(lm, "_ringft_loss_settings", None) is None:
        return
    previous = lm.__dict__.pop("_ringft_previous_forward")
    del lm._ringft_loss_settings
    if getattr(previous, "__func__", None) is getattr(type(lm), "forward", None):
        del lm.forward  # it was the class's own
    else:
        lm.forward = previous


def ring_loss(model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor | int) -> torch.Tensor:
    """``sum of this rank's token losses in batch / num_items`` through ``model`` (wrapped or not)."""
    out = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        shift_labels=batch["shift_labels"],
        num_items_in_batch=num_items,
        **_offsets(batch),
        **{RING_LOSS: True},
    )
    return out["loss"] if isinstance(out, dict) else out.loss


def _cp_sum(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    if layout.cp_size > 1:
        on = x if dist.get_backend(layout.cp_group) == "nccl" else x.cpu()
        dist.all_reduce(on, group=layout.cp_group)
        x = on.to(x.device)
    return x


def eval_loss_sum(model: torch.nn.Module, batch: dict[str, Any], layout: ParallelLayout) -> torch.Tensor:
    """The CP group's summed token loss of one eval batch (fp32 0-d, the same on every CP rank;
    chunked, no logits)."""
    with torch.no_grad():
        one = torch.ones((), dtype=torch.float32, device=batch["input_ids"].device)
        return _cp_sum(ring_loss(model, batch, one).detach().float().reshape(1), layout)[0]


def predict_logits(
    model: torch.nn.Module, batch: dict[str, Any], layout: ParallelLayout, length: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full logits ``(batch, length, vocab)`` of an eval batch, gathered within the CP group and
    put back in sequence order (zigzag, or the Ulysses x ring layout of ``layout.ulysses_size``;
    the ring's padding cut off), and the CP group's summed token loss (None without
    labels), computed from the local logits as transformers' loss computes it (fp32 upcast)."""
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **_offsets(batch),
        )
        local = out["logits"] if isinstance(out, dict) else out.logits
        loss_sum = None
        if batch.get("shift_labels") is not None:
            flat = local.float().reshape(-1, local.shape[-1])
            total = torch.nn.functional.cross_entropy(
                flat, batch["shift_labels"].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            loss_sum = _cp_sum(total.reshape(1), layout)[0]
        ulysses = getattr(layout, "ulysses_size", 1)
        full = cp_gather(local.contiguous(), layout.cp_group, ulysses) if layout.cp_size > 1 else local
        return full[:, :length].contiguous(), loss_sum
