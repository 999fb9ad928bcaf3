"""The model call of a ring trainer: ringft's chunked loss *through* DDP / DeepSpeed / FSDP.

The chunked loss (``ringft.loss.causal_lm_loss``: decoder -> ``lm_head`` in token chunks, never
the full ``(tokens, vocab)`` logits) must run inside the wrapped model's forward, so that DDP's
reducer, ZeRO-3's parameter gathering and FSDP's unsharding see one ordinary forward.
:func:`install_ring_loss_forward` therefore gives the causal LM (under its peft wrapper, if any) a
forward that takes more keywords: ``model(..., ringft_loss=True, ringft_loss_scale=s)`` returns
``CausalLMOutputWithPast(loss=s x sum of this rank's token losses / num_items_in_batch)``; without
``ringft_loss`` the forward is the previous one (generation, TRL's own fused head, ``predict``'s logits). The
wrapper keeps the model's signature (``Trainer`` reads the column names from it) and binds to the
instance, so a deep copy of the model binds to the copy.

A wrapper may cast that output: FSDP2's ``MixedPrecisionPolicy(output_dtype=bf16)`` (accelerate's,
on every ``fully_shard``, the root model too) rounds it to bf16. So the scale is applied inside, in
fp32, before the cast (the backward through the cast carries an exact 1), the forward keeps its
fp32 result on the model (detached), and :func:`ring_loss` returns a loss whose *value* is that fp32
result and whose gradient flows through the wrapper's output: the Trainer logs the fp32 loss.

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

from ringft.data.hf_batch import RING_ROWS
from ringft.loss import causal_lm_loss
from ringft.loss.module import cp_load_balancing_loss
from ringft.loss.router import router_loss_settings
from ringft.model.inputs import OFFSETS
from ringft.model.unwrap import pretrained_model
from ringft.ops.parallel import ParallelLayout
from ringft.ops.sharding import cp_gather

__all__ = [
    "RING_LOSS",
    "eval_loss_sum",
    "install_ring_loss_forward",
    "predict_logits",
    "remove_ring_loss_forward",
    "ring_loss",
]

RING_LOSS = "ringft_loss"
RING_LOSS_SCALE = "ringft_loss_scale"
RING_ROUTER_SCALE = "ringft_router_scale"  # multiplies a router load-balancing term (evaluation)
_LAST_LOSS = "_ringft_last_loss"  # the forward's fp32 scaled loss (detached), on the causal LM
IGNORE_INDEX = -100


def _offsets(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's per-row global document offsets, as the ring's decoder keyword (if any)."""
    return {} if batch.get(OFFSETS) is None else {OFFSETS: batch[OFFSETS]}


def _rows(batch: dict[str, Any]) -> dict[str, Any]:
    """The rows a router load-balancing loss counts (:data:`ringft.data.hf_batch.RING_ROWS`), if any."""
    return {} if batch.get(RING_ROWS) is None else {RING_ROWS: batch[RING_ROWS]}


@dataclass
class _LossSettings:
    chunk_size: int
    offload_activations: bool
    chunked: bool = True


def install_ring_loss_forward(
    model: torch.nn.Module, chunk_size: int, offload_activations: bool, chunked: bool = True
) -> None:
    """Give ``model``'s causal LM the ``ringft_loss=True`` forward (idempotent: a second call
    updates the settings). ``offload_activations`` keeps the decoder's saved activations in CPU
    memory (``torch.autograd.graph.save_on_cpu``); ``chunked=False``: the LM's full logits in one
    piece instead of ``chunk_size`` token chunks."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm = pretrained_model(model)
    settings = _LossSettings(chunk_size, offload_activations, chunked)
    if getattr(lm, "_ringft_loss_settings", None) is not None:
        lm._ringft_loss_settings = settings
        return

    @functools.wraps(type(lm).forward)
    def ring_forward(
        self,
        *args: Any,
        ringft_loss: bool = False,
        ringft_loss_scale: int | float = 1,
        ringft_router_scale: Any = 1,
        **kwargs: Any,
    ) -> Any:
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
            chunked=s.chunked,
            chunk_size=s.chunk_size,
            offload_activations=s.offload_activations,
            router_rows=kwargs.get(RING_ROWS),
            router_scale=ringft_router_scale,
        )
        loss = loss * ringft_loss_scale if ringft_loss_scale != 1 else loss
        setattr(self, _LAST_LOSS, loss.detach())
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
    lm.__dict__.pop(_LAST_LOSS, None)
    if getattr(previous, "__func__", None) is getattr(type(lm), "forward", None):
        del lm.forward  # it was the class's own
    else:
        lm.forward = previous


def _ring_loss_model(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM with the ring-loss forward inside ``model`` (under DDP / FSDP / DeepSpeed / peft)."""
    for m in model.modules():
        if getattr(m, "_ringft_loss_settings", None) is not None:
            return m
    raise TypeError(f"{type(model).__name__} has no ring-loss forward (install_ring_loss_forward)")


def ring_loss(
    model: torch.nn.Module,
    batch: dict[str, Any],
    num_items: torch.Tensor | int,
    scale: int | float = 1,
    router_scale: Any = 1,
) -> torch.Tensor:
    """``scale x sum of this rank's token losses in batch / num_items`` through ``model`` (wrapped
    or not), plus ``scale x router_scale x`` this rank's share of a router load-balancing loss
    (:func:`ringft.loss.causal_lm_loss`): fp32, its value the forward's own even when a wrapper
    cast the output (the gradient flows through the wrapper's output)."""
    out = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        shift_labels=batch["shift_labels"],
        num_items_in_batch=num_items,
        **_offsets(batch),
        **_rows(batch),
        **{RING_LOSS: True, RING_LOSS_SCALE: scale},
        **({} if isinstance(router_scale, int) and router_scale == 1 else {RING_ROUTER_SCALE: router_scale}),
    )
    loss = out["loss"] if isinstance(out, dict) else out.loss
    exact = getattr(_ring_loss_model(model), _LAST_LOSS)
    if loss.dtype == exact.dtype:
        return loss
    # value: exact (the difference of two floats within a factor 2 of each other is exact in fp32,
    # so the sum is exact too); gradient: 1 through the cast output.
    loss = loss.to(exact.dtype)
    return loss + (exact - loss).detach()


def _cp_sum(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    if layout.cp_size > 1:
        on = x if dist.get_backend(layout.cp_group) == "nccl" else x.cpu()
        dist.all_reduce(on, group=layout.cp_group)
        x = on.to(x.device)
    return x


def eval_loss_sum(
    model: torch.nn.Module, batch: dict[str, Any], layout: ParallelLayout, router_scale: Any = 1
) -> torch.Tensor:
    """The CP group's summed token loss of one eval batch (fp32 0-d, the same on every CP rank;
    chunked, no logits), plus ``router_scale x coef x aux`` for a model whose forward adds a router
    load-balancing loss (pass the count the sum is divided by)."""
    with torch.no_grad():
        one = torch.ones((), dtype=torch.float32, device=batch["input_ids"].device)
        loss = ring_loss(model, batch, one, router_scale=router_scale)
        return _cp_sum(loss.detach().float().reshape(1), layout)[0]


def predict_logits(
    model: torch.nn.Module, batch: dict[str, Any], layout: ParallelLayout, length: int, router_scale: Any = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full logits ``(batch, length, vocab)`` of an eval batch, gathered within the CP group and
    put back in sequence order (zigzag, or the Ulysses x ring layout of ``layout.ulysses_size``;
    the ring's padding cut off), and the CP group's summed token loss (None without
    labels), computed from the local logits as transformers' loss computes it (fp32 upcast), plus
    ``router_scale x coef x aux`` as :func:`eval_loss_sum`."""
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
            router = router_loss_settings(model)
            if router is not None:
                logits = out["router_logits"] if isinstance(out, dict) else out.router_logits
                aux, _ = cp_load_balancing_loss(model, router, logits, batch.get(RING_ROWS))
                loss_sum = loss_sum + router.coef * router_scale * aux.float()
        ulysses = getattr(layout, "ulysses_size", 1)
        full = cp_gather(local.contiguous(), layout.cp_group, ulysses) if layout.cp_size > 1 else local
        return full[:, :length].contiguous(), loss_sum
