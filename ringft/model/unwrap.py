"""Where the parts of a transformers causal LM are, with or without a peft wrapper.

One place for the unwrapping that the ring patch, the loss, the trainer and inference all need.
"""

from __future__ import annotations

from torch import nn

__all__ = ["decoder", "output_head", "present_no_split_modules", "pretrained_model"]


def pretrained_model(model: nn.Module) -> nn.Module:
    """The transformers ``PreTrainedModel`` inside a peft wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (e.g. ``LlamaModel``): takes ``input_ids`` ``(batch, seq)`` and
    ``position_ids`` ``(batch, seq)``, returns ``last_hidden_state`` ``(batch, seq, hidden)``.

    Works for ``*ForCausalLM`` and for the bare base model, peft-wrapped or not.
    """
    inner = pretrained_model(model)
    base = getattr(inner, "base_model", inner)
    if base is inner and isinstance(getattr(inner, "model", None), nn.Module):
        return inner.model  # a prefix that names no attribute (Llama4ForCausalLM: "language_model")
    return base


def output_head(model: nn.Module) -> nn.Module:
    """The output projection (``lm_head``, weight ``(vocab, hidden)``) of a causal LM."""
    inner = pretrained_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embeddings (get_output_embeddings())")
    return head


def present_no_split_modules(model: nn.Module) -> list[str]:
    """Narrow the model's ``_no_split_modules`` (the decoder-layer classes that accelerate's FSDP
    ``TRANSFORMER_BASED_WRAP`` wraps when the launch config names none) to the classes the model
    really contains, and return them. A text-only model of a multimodal family (Qwen3.5) lists its
    vision blocks too, which accelerate refuses as "not found in the model". Sets an instance
    attribute; the class's list is left alone."""
    inner = pretrained_model(model)
    listed = getattr(inner, "_no_split_modules", None)
    if not listed:
        return []
    present = {type(m).__name__ for m in inner.modules()}
    kept = [name for name in listed if name in present]
    inner._no_split_modules = kept
    return kept
