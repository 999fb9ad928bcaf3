"""The chunked loss with a model's own ``lm_head``, whatever wraps or shards it.

Three routes, chosen by :func:`lm_loss_from_hidden` from the head module:

- a plain head (a readable ``(V, H)`` weight, optional bias): the fused :func:`chunked_lm_loss`;
- a DeepSpeed ZeRO-3-partitioned head: the fused loss runs *inside one call of the head module*
  (its ``forward`` is swapped for the duration of the call), so ZeRO-3's module hooks gather the
  weight once for the forward and once for the backward (where the pre-backward hook re-gathers
  it before the fused backward reads it, and the gradient is reduce-scattered by the parameter's
  own hook), instead of once per chunk, twice;
- a head that must be called as a module for every chunk (a LoRA adapter on ``lm_head``, or a
  weight sharded as a DTensor): :func:`checkpointed_head_loss`, each chunk under non-reentrant
  activation checkpointing (the chunk's logits are recomputed in the backward).

All three return ``sum of token cross-entropies / num_items_in_batch`` (fp32; fp64 for fp64 input)
and keep the memory bound ``O(chunk_size * vocab)``.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from ringft.loss.chunked import check_chunking, chunked_lm_loss, given_denominator
from ringft.model.unwrap import output_head, pretrained_model
from ringft.ops.dtypes import accumulator_dtype

__all__ = ["checkpointed_head_loss", "lm_loss_from_hidden", "output_projection"]


def _chunk_ce_sum(head: nn.Module, h: Tensor, targets: Tensor) -> Tensor:
    logits = head(h)
    return torch.nn.functional.cross_entropy(
        logits.to(accumulator_dtype(logits.dtype)), targets, reduction="sum"
    )


def checkpointed_head_loss(
    head: nn.Module,
    hidden: Tensor,
    labels: Tensor,
    *,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> Tensor:
    """The loss of :func:`chunked_lm_loss`, calling the ``head`` module on each chunk of tokens
    under non-reentrant :func:`torch.utils.checkpoint.checkpoint` (logits recomputed in backward).

    For heads that are not a plain readable ``(weight, bias)``: LoRA on ``lm_head``, a sharded
    weight (its module hooks gather it and reduce the gradient). ``hidden`` ``(batch, seq, H)``,
    ``labels`` pre-shifted ``(batch, seq)``; returns an fp32 scalar (fp64 for fp64 inputs).

    Chunks are windows of ``chunk_size`` token *positions* (the valid tokens in each are gathered),
    so the module is called ``ceil(batch * seq / chunk_size)`` times, in the forward and again in
    the backward, however many targets are masked: when each call is a collective, every rank
    issues the same number as long as ranks hold the same number of local tokens (the trainer pads
    every batch to ``data.seq_len``).
    """
    check_chunking(hidden, labels, chunk_size)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1).to(device=flat_h.device, dtype=torch.long)
    acc = accumulator_dtype(hidden.dtype)
    # Starts from 0 * sum(hidden[:1]) so that an all-ignored input still returns a graph-connected
    # zero (every rank must run backward for DDP / ZeRO even when it holds no valid target).
    total = flat_h[:1].sum().to(acc) * 0
    n_valid = 0
    for start in range(0, flat_y.numel(), chunk_size):
        window = flat_y[start : start + chunk_size]
        idx = torch.nonzero(window != ignore_index).squeeze(1) + start
        n_valid += idx.numel()
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_ce_sum, head, flat_h.index_select(0, idx), flat_y.index_select(0, idx), use_reentrant=False
        )
    denom = given_denominator(num_items_in_batch)
    if denom is None:
        denom = torch.as_tensor(max(1, n_valid))
    return total / denom.reshape(()).to(device=hidden.device, dtype=acc)


def _has_active_lora(head: nn.Module) -> bool:
    lora_a = getattr(head, "lora_A", None)
    return (
        lora_a is not None
        and len(lora_a) > 0
        and not getattr(head, "disable_adapters", False)
        and not getattr(head, "merged", False)
    )


def _is_zero3(head: nn.Module) -> bool:
    return hasattr(head.weight, "ds_id")


def _needs_module_call(head: nn.Module) -> str | None:
    """Why ``head`` cannot be read as a plain ``(weight, bias)`` pair, or None when it can."""
    if _has_active_lora(head):
        return "lm_head carries a LoRA adapter"
    weight = head.weight
    if _is_zero3(head):
        return "lm_head.weight is a DeepSpeed ZeRO-3 parameter"
    if weight.numel() == 0 or type(weight).__name__ == "DTensor":
        return "lm_head.weight is sharded"
    return None


def output_projection(model: nn.Module) -> nn.Module:
    """The output-embedding module (``lm_head``, weight ``(V, H)``) of a transformers causal LM,
    peft-wrapped or not, checked to be usable as a plain ``(weight, bias)`` projection by
    :func:`chunked_lm_loss`.

    Raises ``NotImplementedError`` naming the reason (LoRA on ``lm_head``, a ZeRO-3 / sharded weight)
    otherwise; :func:`lm_loss_from_hidden` handles those.
    """
    head = output_head(model)
    why = _needs_module_call(head)
    if why is not None:
        raise NotImplementedError(f"{why}: use lm_loss_from_hidden / checkpointed_head_loss instead")
    return head


def _fused_loss_in_one_head_call(
    head: nn.Module, hidden: Tensor, labels: Tensor, denom: Tensor | None, chunk_size: int, ignore_index: int
) -> Tensor:
    """:func:`chunked_lm_loss` computed inside one ``head(...)`` call, so that the module's hooks
    (ZeRO-3: gather before the forward, re-gather before the backward, release after) run once."""

    def fused_forward(h: Tensor, y: Tensor, d: Tensor | None) -> Tensor:
        return chunked_lm_loss(
            h,
            head.weight,
            y,
            num_items_in_batch=d,
            bias=getattr(head, "bias", None),
            chunk_size=chunk_size,
            ignore_index=ignore_index,
        )

    had_own_forward = "forward" in head.__dict__
    previous = head.__dict__.get("forward")
    head.forward = fused_forward
    try:
        return head(hidden, labels, denom)
    finally:
        if had_own_forward:
            head.forward = previous
        else:
            del head.forward


def lm_loss_from_hidden(
    model: nn.Module,
    hidden: Tensor,
    labels: Tensor,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> Tensor:
    """Chunked loss with ``model``'s ``lm_head`` (``get_output_embeddings()``).

    ``hidden`` is the base model's ``last_hidden_state`` ``(batch, seq_local, H)`` and ``labels``
    the pre-shifted ``(batch, seq_local)`` targets, e.g. ``model.model(input_ids,
    position_ids=...).last_hidden_state`` with the collator's ``shift_labels``. Works for
    ``LlamaForCausalLM`` / ``MistralForCausalLM`` and their peft wrappers (tied embeddings too).
    Returns the fp32 scalar ``sum of token CE / num_items_in_batch`` (see the module docstring for
    the route taken per kind of head).
    """
    config = getattr(pretrained_model(model), "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise NotImplementedError("logit soft-capping (final_logit_softcapping) is not supported")
    head = output_head(model)
    why = _needs_module_call(head)
    if why is None:
        return chunked_lm_loss(
            hidden,
            head.weight,
            labels,
            num_items_in_batch=num_items_in_batch,
            bias=getattr(head, "bias", None),
            chunk_size=chunk_size,
            ignore_index=ignore_index,
        )
    if _is_zero3(head) and not _has_active_lora(head):
        check_chunking(hidden, labels, chunk_size)
        denom = given_denominator(num_items_in_batch)
        return _fused_loss_in_one_head_call(head, hidden, labels, denom, chunk_size, ignore_index)
    return checkpointed_head_loss(
        head,
        hidden,
        labels,
        num_items_in_batch=num_items_in_batch,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
    )
