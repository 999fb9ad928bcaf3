"""TRL's fused LM head on the ring: whole-sequence per-token outputs from CP-sharded forwards.

TRL's ``DPOTrainer`` and ``GRPOTrainer`` score sequences through ``model(input_ids, attention_mask,
labels, fused_lm_head=True)`` (``trl.trainer.utils.add_fused_lm_head``): the backbone, then the LM
head in token tiles (never the ``(batch, seq, vocab)`` logits), returning per-token fields
``(batch, seq - 1)``: ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ... Everything TRL
computes afterwards (sequence log-probability sums, DPO / GRPO losses, metrics) reads only those
fields and the batch's masks.

:func:`install_ring_fused_head` gives the causal LM a forward that takes the *whole* batch, as TRL
passes it, and returns the *whole* fields, as one process computes them:

1. the batch is padded and sharded for this CP rank (:func:`ringft.data.hf_batch.shard_collated_batch`:
   labels shifted on the whole row, zigzag / Ulysses x ring shards). Left-padded rows (GRPO's
   left-padded prompt + right-padded completion) are first rolled left so that their tokens start
   at position 0 (:func:`left_align`), and their fields rolled back after: the pads are masked keys
   in one process, so each token sees the same tokens at the same relative RoPE distances;
2. TRL's own fused head runs on the shard (its ``shift_labels`` path: pre-shifted targets), the
   decoder on the ring: each position's fields are the one-process fields of that position;
3. each field ``(batch, seq_local)`` is all-gathered over the CP group and put back in sequence
   order (:func:`ringft.ops.sharding.cp_unshard`), cut to ``(batch, seq - 1)``.

Memory: the gathered fields are ``O(batch x seq)`` numbers (8 MB for 2 x 512K fp32 fields), the
logits still ``O(tile x vocab)``.

The gradient: every CP rank of a replica then holds the same fields and computes the same loss
``L`` from them, so ``dL/d(fields)`` is the same on every CP rank; each rank back-propagates its
own slice, and the CP group's parameter gradients sum to the one-process gradient. DDP, DeepSpeed
and FSDP average gradients over all ``dp x cp`` ranks, where one process per replica would be
averaged over ``dp``: the gather's backward multiplies by ``cp`` (the logged loss is untouched).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.distributed as dist

from ringft.data.hf_batch import shard_collated_batch
from ringft.model.unwrap import pretrained_model
from ringft.ops.parallel import ParallelLayout
from ringft.ops.sharding import cp_unshard

__all__ = ["FIELDS", "gather_sequence", "install_ring_fused_head", "left_align", "unwrap_engine"]

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
_PASSED = ("input_ids", "attention_mask", "labels", "position_ids", "use_cache", "num_items_in_batch")
WHERE = "ringft fused LM head"


class _GatherCP(torch.autograd.Function):
    """All-gather ``(batch, L)`` over the CP group -> ``(cp, batch, L)``; backward: this rank's
    slice of the (CP-identical) gradient times ``grad_scale``."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, size: int, rank: int, grad_scale: float):
        ctx.rank, ctx.grad_scale = rank, grad_scale
        local = local.contiguous()
        on = local if dist.get_backend(group) == "nccl" or local.device.type == "cpu" else local.cpu()
        pieces = [torch.empty_like(on) for _ in range(size)]
        dist.all_gather(pieces, on, group=group)
        return torch.stack(pieces).to(local.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad[ctx.rank] * ctx.grad_scale, None, None, None, None


def gather_sequence(local: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """``(batch, seq_pad // cp)`` shards of the CP group -> ``(batch, seq_pad)`` in sequence order
    (differentiable for floating tensors; see the module docstring for the gradient)."""
    if layout.cp_size == 1:
        return local
    if local.is_floating_point() and local.requires_grad:
        stacked = _GatherCP.apply(
            local, layout.cp_group, layout.cp_size, layout.cp_rank, float(layout.cp_size)
        )
    else:
        with torch.no_grad():
            stacked = _GatherCP.apply(local.detach(), layout.cp_group, layout.cp_size, layout.cp_rank, 1.0)
    return cp_unshard(list(stacked.unbind(0)), layout.ulysses_size)


def unwrap_engine(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without its DDP / DeepSpeed / FSDP1 wrappers (``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def left_align(batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Roll each row of the ``(batch, seq)`` tensors left by its count of leading attention-mask
    zeros (left padding becomes right padding). Returns the rolled batch and the per-row shifts
    (None when no row is left-padded: the batch unchanged)."""
    mask = batch.get("attention_mask")
    if mask is None:
        return batch, None
    lead = (mask.cumsum(1) == 0).sum(1)
    if not bool(lead.any()):
        return batch, None
    length = mask.shape[1]
    index = (torch.arange(length, device=mask.device) + lead[:, None]) % length
    rolled = {
        k: v.gather(1, index.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() == 2 else v
        for k, v in batch.items()
    }
    return rolled, lead


def _roll_back(field: torch.Tensor, lead: torch.Tensor) -> torch.Tensor:
    """Fields ``(batch, seq - 1)`` of left-aligned rows -> the original rows' (position ``i`` scores
    token ``i + 1``: original field ``i`` is rolled field ``i - shift``; the wrapped-in positions
    are padding, masked in both)."""
    length = field.shape[1]
    index = (torch.arange(length, device=field.device) - lead.to(field.device)[:, None]) % length
    return field.gather(1, index)


def _ring_call(previous: Any, layout: ParallelLayout, pad_token_id: int, kwargs: dict[str, Any]) -> Any:
    from trl.trainer.utils import FusedCausalLMOutput

    extra = sorted(k for k, v in kwargs.items() if k not in _PASSED and v is not None and v is not False)
    if extra or kwargs.get("labels") is None:
        raise ValueError(
            f"{WHERE}: the ring scores input_ids + labels (+ an attention_mask) only; got "
            f"{extra or 'no labels'}: multimodal inputs, router logits, pre-shifted labels are not supported"
        )
    ids = kwargs["input_ids"]
    batch = {k: kwargs.get(k) for k in ("input_ids", "attention_mask", "labels", "position_ids")}
    batch, lead = left_align(batch)
    local = shard_collated_batch(
        {k: v for k, v in batch.items() if v is not None},
        layout.cp_rank,
        layout.cp_size,
        pad_token_id,
        ulysses_size=layout.ulysses_size,
    )
    device = ids.device
    out = previous(
        input_ids=local["input_ids"].to(device),
        position_ids=local["position_ids"].to(device),
        shift_labels=local["shift_labels"].to(device),
        cu_seqlens=local["cu_seqlens"],
        fused_lm_head=True,
        use_cache=False,
    )
    length = ids.shape[1] - 1  # the one-process fields: position i scores token i + 1
    fields = {
        name: None
        if getattr(out, name, None) is None
        else gather_sequence(getattr(out, name), layout)[:, :length]
        for name in FIELDS
    }
    if lead is not None:
        fields = {k: None if v is None else _roll_back(v, lead) for k, v in fields.items()}
    mask = fields["label_mask"]
    count = (
        mask.sum().clamp(min=1) if kwargs.get("num_items_in_batch") is None else kwargs["num_items_in_batch"]
    )
    return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / count, **fields)


def install_ring_fused_head(model: torch.nn.Module, layout: ParallelLayout, pad_token_id: int) -> None:
    """Make ``model(..., fused_lm_head=True)`` (TRL's fused head, already added) take whole batches
    and return whole fields, computed on the ring (see the module docstring). Idempotent; any other
    call (generation, ``fused_lm_head=False``) goes to the previous forward unchanged. ``model``
    may be wrapped (peft, DDP, a DeepSpeed engine)."""
    lm = pretrained_model(unwrap_engine(model))
    if getattr(lm, "_ringft_fused_layout", None) is not None:
        lm._ringft_fused_layout = (layout, pad_token_id)
        return
    lm._ringft_fused_layout = (layout, pad_token_id)
    previous = lm.forward

    @functools.wraps(type(lm).forward)
    def ring_fused_forward(self, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return previous(*args, **kwargs)
        if args:
            raise ValueError(f"{WHERE}: pass the batch as keywords (input_ids=..., labels=...)")
        ring, pad = self._ringft_fused_layout
        return _ring_call(previous, ring, pad, kwargs)

    lm.forward = types.MethodType(ring_fused_forward, lm)
