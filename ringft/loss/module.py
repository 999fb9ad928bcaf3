"""A causal LM wrapped as ``forward(batch) -> this rank's loss share`` (what DDP / DeepSpeed / FSDP wrap)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from ringft.loss.head import lm_loss_from_hidden
from ringft.loss.router import RouterLoss, load_balancing_loss, router_loss_settings
from ringft.model.patch import ring_spec
from ringft.model.unwrap import decoder, pretrained_model

__all__ = ["CausalLMLoss", "causal_lm_loss", "cp_load_balancing_loss"]


class CausalLMLoss(nn.Module):
    """Wraps a causal LM (a transformers ``*ForCausalLM``, peft-wrapped or not).

    ``forward(input_ids, position_ids, shift_labels, num_items_in_batch, cu_seqlens=None,
    loss_scale=1)`` takes the collator's ``(batch, seq_local)`` tensors (and its per-row global
    document offsets) and the step's denominator (see :func:`ringft.loss.loss_normalization`) and
    returns the fp32 scalar ``loss_scale x sum of this rank's token losses / num_items_in_batch``.

    A wrapper may cast that output: FSDP2's ``MixedPrecisionPolicy(output_dtype=bf16)`` (what
    accelerate applies to every ``fully_shard``, this root module too) rounds it to bf16. So the
    scale is applied here, in fp32, before any cast (the backward through the cast then carries an
    exact 1, whatever the scale), and :attr:`last_loss` keeps the unscaled fp32 share of the last
    forward (detached) for logging.

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
        self.last_loss: Tensor | None = None

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
        loss_scale: int | float = 1,
        **_: Any,
    ) -> Tensor:
        """This rank's loss share for ``(batch, seq_local)`` inputs times ``loss_scale`` (fp32 scalar;
        the unscaled share is kept in :attr:`last_loss`)."""
        loss = causal_lm_loss(
            self.model,
            input_ids,
            position_ids,
            shift_labels,
            num_items_in_batch,
            cu_seqlens=cu_seqlens,
            chunked=self.chunked,
            chunk_size=self.chunk_size,
            offload_activations=self.offload_activations,
        )
        self.last_loss = loss.detach()
        return loss * loss_scale if loss_scale != 1 else loss


def _model_call(
    input_ids: Tensor, cu_seqlens: list[list[int]] | None, offload_activations: bool
) -> tuple[dict[str, Any], contextlib.AbstractContextManager]:
    """The model call's document keyword (if any) and the context it runs in. Offload wraps only
    the decoder, whose checkpointed layer inputs are what it is for (wrapping the loss too would copy
    the lm_head weight to CPU every step)."""
    documents = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=input_ids.is_cuda)
        if offload_activations
        else contextlib.nullcontext()
    )
    return documents, offload


def causal_lm_loss(
    model: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    shift_labels: Tensor,
    num_items_in_batch: Tensor | int,
    *,
    cu_seqlens: list[list[int]] | None = None,
    chunked: bool,
    chunk_size: int,
    offload_activations: bool,
    router_rows: Tensor | None = None,
    router_scale: float | Tensor = 1,
) -> Tensor:
    """``sum of the token losses of (batch, seq_local) inputs / num_items_in_batch`` (fp32 scalar)
    of a causal LM (peft-wrapped or not): the one loss path of :class:`CausalLMLoss` and of
    ``ringft.RingTrainerMixin`` (see :class:`CausalLMLoss` for the arguments).

    A mixture-of-experts LM whose transformers forward adds the router load-balancing loss
    (``config.output_router_logits``; :func:`ringft.loss.router.router_loss_settings`) gets this
    rank's share of it too: ``router_aux_loss_coef x aux / cp``, ``aux`` over the CP group's whole
    sequence (:mod:`ringft.loss.router`); ``router_rows`` ``(batch, seq_local)``: the rows it
    counts (the one-process batch's attention mask; None: every row); ``router_scale`` multiplies
    that term (an evaluation that divides the summed loss by its token count later passes it)."""
    router = router_loss_settings(model)
    if router is not None:
        return _with_router_loss(
            model,
            router,
            input_ids,
            position_ids,
            shift_labels,
            num_items_in_batch,
            cu_seqlens=cu_seqlens,
            chunked=chunked,
            chunk_size=chunk_size,
            offload_activations=offload_activations,
            router_rows=router_rows,
            router_scale=router_scale,
        )
    documents, offload = _model_call(input_ids, cu_seqlens, offload_activations)
    if chunked:
        with offload:
            hidden = decoder(model)(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **documents
            ).last_hidden_state
        return lm_loss_from_hidden(model, hidden, shift_labels, num_items_in_batch, chunk_size=chunk_size)
    with offload:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **documents)
    return _full_logits_loss(model, out.logits, shift_labels, num_items_in_batch)


def _full_logits_loss(
    model: nn.Module, logits: Tensor, shift_labels: Tensor, num_items_in_batch: Any
) -> Tensor:
    """transformers' own loss of the LM's full ``(batch, seq, vocab)`` logits (fp32), computed here
    rather than in the LM's forward: called from inside the forward of an FSDP2 root module (the
    ring trainer's loss forward), the model's output, its loss too, is cast to ``output_dtype``."""
    lm = pretrained_model(model)
    return lm.loss_function(
        logits,
        shift_labels,
        lm.config.vocab_size,
        num_items_in_batch=num_items_in_batch,
        shift_labels=shift_labels,
    )


def _with_router_loss(
    model: nn.Module,
    router: RouterLoss,
    input_ids: Tensor,
    position_ids: Tensor,
    shift_labels: Tensor,
    num_items_in_batch: Tensor | int,
    *,
    cu_seqlens: list[list[int]] | None,
    chunked: bool,
    chunk_size: int,
    offload_activations: bool,
    router_rows: Tensor | None,
    router_scale: float | Tensor,
) -> Tensor:
    """:func:`causal_lm_loss` of an LM whose forward adds the load-balancing loss: the token-loss
    share plus ``coef x aux / cp``. The unchunked path asks the LM for logits and router logits and
    applies its own ``loss_function`` (its forward would add an ``aux`` of this rank's rows only)."""
    documents, offload = _model_call(input_ids, cu_seqlens, offload_activations)
    call = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, output_router_logits=True)
    if chunked:
        with offload:
            out = decoder(model)(**call, **documents)
        loss = lm_loss_from_hidden(
            model, out.last_hidden_state, shift_labels, num_items_in_batch, chunk_size=chunk_size
        )
    else:
        with offload:
            out = model(**call, **documents)
        loss = _full_logits_loss(model, out.logits, shift_labels, num_items_in_batch)
    aux, cp = cp_load_balancing_loss(model, router, out.router_logits, router_rows)
    return loss + (router.coef * router_scale / cp) * aux.to(loss.dtype)


def cp_load_balancing_loss(
    model: nn.Module, router: RouterLoss, router_logits: Any, rows: Tensor | None
) -> tuple[Tensor, int]:
    """``(aux, cp)``: the load-balancing loss over the whole sequence of ``model``'s CP group (the
    same on every rank) and the group's size (1 without the ring)."""
    spec = ring_spec(model)
    group, cp = (spec.group, spec.size) if spec is not None else (None, 1)
    return load_balancing_loss(router_logits, router.num_experts, router.top_k, rows, group, cp), cp
