"""A causal LM wrapped as ``forward(batch) -> this rank's loss share`` (what DDP / DeepSpeed / FSDP wrap)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from ringft.loss.head import lm_loss_from_hidden
from ringft.model.unwrap import decoder, pretrained_model

__all__ = ["CausalLMLoss"]


class CausalLMLoss(nn.Module):
    """Wraps a causal LM (a transformers ``*ForCausalLM``, peft-wrapped or not).

    ``forward(input_ids, position_ids, shift_labels, num_items_in_batch, cu_seqlens=None)`` takes
    the collator's ``(batch, seq_local)`` tensors (and its per-row global document offsets) and the
    step's denominator (see :func:`ringft.loss.loss_normalization`) and returns the fp32 scalar
    ``sum of this rank's token losses / num_items_in_batch``.

    Args:
        model: the causal LM.
        chunked: LM head + cross-entropy in token chunks (:func:`ringft.loss.lm_loss_from_hidden`,
            no full logits); else transformers' own loss on full logits.
        chunk_size: tokens per logits chunk.
        offload_activations: keep the decoder's saved activations (with checkpointing: the layer
            inputs) in CPU memory (``torch.autograd.graph.save_on_cpu``).
    """

    def __init__(self, model: nn.Module, chunked: bool, chunk_size: int, offload_activations: bool):
        super().__init__()
        self.model = model
        self.chunked, self.chunk_size = chunked, chunk_size
        self.offload_activations = offload_activations

    @property
    def config(self):
        """The model's config (accelerate's DeepSpeed setup sizes its buckets from ``hidden_size``)."""
        return pretrained_model(self.model).config

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        shift_labels: Tensor,
        num_items_in_batch: Tensor | int,
        cu_seqlens: list[list[int]] | None = None,
        **_: Any,
    ) -> Tensor:
        """This rank's loss share for ``(batch, seq_local)`` inputs (fp32 scalar)."""
        documents = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        # Offload wraps only the decoder, whose checkpointed layer inputs are what it is for
        # (wrapping the loss too would copy the lm_head weight to CPU every step).
        offload = (
            torch.autograd.graph.save_on_cpu(pin_memory=input_ids.is_cuda)
            if self.offload_activations
            else contextlib.nullcontext()
        )
        if self.chunked:
            with offload:
                hidden = decoder(self.model)(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, **documents
                ).last_hidden_state
            return lm_loss_from_hidden(
                self.model, hidden, shift_labels, num_items_in_batch, chunk_size=self.chunk_size
            )
        with offload:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                labels=shift_labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                use_cache=False,
                **documents,
            )
        return out.loss
