"""``attention_checkpoint``: whether a checkpointed decoder layer's recompute runs the ring forward.

- ``recompute`` (default): activation checkpointing recomputes the whole layer in the backward,
  ring attention forward included (a full ring pass: N block steps and K/V exchanges);
- ``save``: each layer's ring attention output and log-sum-exp, kept from the forward, are handed
  to the recompute, which skips the ring forward (the backward is unchanged and exact);
- ``offload``: the same, kept in host memory (pinned on CUDA) and copied back for the backward.

How: transformers checkpoints each layer with its ``_gradient_checkpointing_func`` (set by
``gradient_checkpointing_enable``; ``partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
...)``). The decoder pre-hook (:func:`prepare_attention_checkpoint`) wraps it so that every call
passes :func:`ringft.ops.saved_attention.checkpoint_contexts` as torch's ``context_fn``: the forward
and the recompute of one layer call share one :class:`~ringft.ops.saved_attention.AttentionStore`,
which the ring attention reads (:func:`ringft.ops.saved_attention.active_store`). Wrapping at each
forward follows checkpointing that is enabled after the model went on the ring (the Trainer enables
it when training starts).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ringft.ops.saved_attention import checkpoint_contexts

__all__ = ["ATTENTION_CHECKPOINT", "prepare_attention_checkpoint", "unwrap_checkpointing"]

ATTENTION_CHECKPOINT = ("recompute", "save", "offload")
_NEEDS = (
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), "
    "the recipe's train.gradient_checkpointing or the Trainer's activation_checkpointing"
)


class _KeepingAttention:
    """A layer's checkpointing function, with the attention store as torch's ``context_fn``."""

    def __init__(self, inner, offload: bool):
        self.inner, self.offload = inner, offload

    def __call__(self, function, *args: Any, **kwargs: Any):
        contexts = functools.partial(checkpoint_contexts, self.offload)
        return self.inner(function, *args, context_fn=contexts, **kwargs)


def _checkpointing_problem(inner: Any, mode: str) -> str | None:
    keywords = inner.keywords if isinstance(inner, functools.partial) else {}
    if keywords.get("use_reentrant") is True:
        return (
            f"attention_checkpoint={mode!r} needs non-reentrant checkpointing (use_reentrant=True has no "
            "recompute hook): enable it with gradient_checkpointing_kwargs={'use_reentrant': False}, or "
            "use attention_checkpoint='recompute'"
        )
    if "context_fn" in keywords:
        return (
            f"attention_checkpoint={mode!r} sets the checkpoint's context_fn, which already has one: drop "
            "context_fn from the gradient checkpointing kwargs, or use attention_checkpoint='recompute'"
        )
    return None


def _layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in decoder.modules() if hasattr(m, "_gradient_checkpointing_func")]


def prepare_attention_checkpoint(decoder: torch.nn.Module, mode: str) -> None:
    """Before a forward of ``decoder`` (a transformers decoder stack): make its checkpointed layers
    keep their ring attention outputs (``mode`` ``save`` / ``offload``). Raises ``ValueError`` for a
    training forward without checkpointing (there is no recompute to spare: the layers keep their
    activations anyway) and for reentrant checkpointing."""
    if mode == "recompute" or not (decoder.training and torch.is_grad_enabled()):
        return
    layers = _layers(decoder)
    if not any(getattr(m, "gradient_checkpointing", False) for m in layers):
        raise ValueError(
            f"attention_checkpoint={mode!r} saves what gradient checkpointing would recompute, but the "
            f"model's layers are not checkpointed (without checkpointing nothing is recomputed): enable "
            f"it ({_NEEDS}), or use attention_checkpoint='recompute'"
        )
    offload = mode == "offload"
    for layer in layers:
        func = layer._gradient_checkpointing_func
        if isinstance(func, _KeepingAttention):
            if func.offload == offload:
                continue
            func = func.inner
        problem = _checkpointing_problem(func, mode)
        if problem:
            raise ValueError(problem)
        layer._gradient_checkpointing_func = _KeepingAttention(func, offload)


def unwrap_checkpointing(decoder: torch.nn.Module) -> None:
    """Give every layer of ``decoder`` back its own checkpointing function."""
    for layer in _layers(decoder):
        func = layer._gradient_checkpointing_func
        if isinstance(func, _KeepingAttention):
            layer._gradient_checkpointing_func = func.inner
