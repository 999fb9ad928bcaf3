"""transformers integration: run LLaMA / Mistral attention as zigzag ring attention.

transformers (>= 5) routes the attention of LLaMA-style models through its ``AttentionInterface``
registry: the attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
q ``(batch, heads_q, seq_local, head_dim)`` and k/v ``(batch, heads_kv, seq_local, head_dim)``
(RoPE applied, GQA not expanded). :func:`apply_ring_attention` registers the ring under the plain
name ``zigzag_ring`` (names containing "flash", "sdpa", "flex" or "/" trigger other code paths in
transformers) and switches the model to it: this is ringft's "monkey-patch" of the
flash-attention forward, done through the route transformers offers instead of replacing classes.

No mask function is registered, so transformers hands the attention ``attention_mask=None``. A
forward pre-hook on the decoder therefore checks each forward's inputs once, on every CP rank
together (one small all_gather; :mod:`ringft.model.inputs`): it refuses padding masks (they would
otherwise be dropped), insists on the global position ids that RoPE needs, refuses RoPE types that
are not exact under zigzag sharding, checks that every rank got the same shapes and document
offsets, and turns the offsets (the batch's ``cu_seqlens``, or transformers' ``cu_seq_lens_q/k``)
into this rank's document plan. The per-layer attention calls then skip that collective. Keyword
arguments of the decoder reach the attention function, which is how :mod:`ringft.model.inference`
hands it its KV cache (``ring_cache=``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringft.model.inputs import CHECKED, DOCUMENTS, check_forward_inputs
from ringft.model.rope import rope_problem
from ringft.model.unwrap import decoder, pretrained_model
from ringft.ops import ShardedKVCache, zigzag_ring_attention
from ringft.ops.comm import group_rank_and_size

__all__ = [
    "ATTENTION_NAME",
    "RingSpec",
    "apply_ring_attention",
    "remove_ring_attention",
    "ring_attention",
    "ring_attention_forward",
    "ring_spec",
]

ATTENTION_NAME = "zigzag_ring"
TESTED_MODEL_TYPES = ("llama", "mistral")
MIN_TRANSFORMERS = (5, 0)


@dataclass(frozen=True)
class RingSpec:
    """How a model's attention runs on the ring: the CP group (``size`` ranks, this one ``rank``)
    and the block backend; set by :func:`apply_ring_attention`, read with :func:`ring_spec`."""

    group: Any
    backend: str
    size: int
    rank: int
    previous_implementation: str | None


def ring_spec(model: torch.nn.Module) -> RingSpec | None:
    """The :class:`RingSpec` of a model switched to the ring (peft-wrapped or not), else None."""
    return getattr(pretrained_model(model), "_ringft_ring", None)


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    ring_cache: ShardedKVCache | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``zigzag_ring`` in transformers' ``AttentionInterface``.

    Takes q ``(B, Hq, S_local, D)``, k/v ``(B, Hkv, S_local, D)``; returns
    ``((B, S_local, Hq, D) contiguous, None)``. transformers' ``scaling`` is the softmax scale.
    With ``ring_cache`` (inference) the first call of a layer is the ring prefill, which keeps the
    layer's local K/V in the cache; later calls decode one token against the sharded cache.
    """
    spec: RingSpec | None = getattr(module, "_ringft_ring", None)
    if spec is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} but was not prepared "
            "by ringft.apply_ring_attention(model, cp_group): call it on the model first"
        )
    if attention_mask is not None:
        raise ValueError(
            "zigzag ring attention got an attention mask; padding masks are not supported. Right-pad "
            "with RingDataCollator (pads are excluded from the loss by ignore_index) instead of masking"
        )
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by ring attention: set "
            "config.attention_dropout = 0.0"
        )
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
    if ring_cache is not None and ring_cache.is_filled(module.layer_idx):
        out = ring_cache.decode_attention(
            module.layer_idx,
            q,
            k,
            v,
            softmax_scale=scaling,
            group=spec.group,
            backend=spec.backend,
            sliding_window=sliding_window,
        )
        return out.contiguous(), None
    tokens = ring_cache.length if ring_cache is not None else q.shape[1] * spec.size
    if sliding_window is not None and tokens > sliding_window:
        padded = "" if ring_cache is not None else " (padded to a multiple of 2 * cp_size)"
        raise ValueError(
            f"the model has sliding_window={sliding_window} but the sequence has {tokens} tokens{padded}: "
            "ring attention computes full causal attention and would silently ignore the window. "
            "Set model.config.sliding_window = None (as Mistral v0.2+ does for long context) or use "
            f"sequences of at most {sliding_window} tokens"
        )
    out = zigzag_ring_attention(
        q,
        k,
        v,
        causal=getattr(module, "is_causal", True),
        softmax_scale=scaling,
        group=spec.group,
        backend=spec.backend,
        validate=not kwargs.get(CHECKED, False),
        cu_seqlens=kwargs.get(DOCUMENTS),
    )
    if ring_cache is not None:
        ring_cache.store_prefill(module.layer_idx, k, v)
    return out.contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "layer_idx")
    ]


def _input_check_hook(spec: RingSpec, config):
    def hook(module, args, kwargs):
        check_forward_inputs(spec, config, module, args, kwargs)
        return args, kwargs

    return hook


def apply_ring_attention(
    model: torch.nn.Module,
    cp_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    *,
    allow_untested: bool = False,
) -> torch.nn.Module:
    """Switch a LLaMA- or Mistral-family model to zigzag ring attention over ``cp_group``.

    Idempotent (a second call updates the group/backend); undo with :func:`remove_ring_attention`.
    Works on a peft-wrapped model too. Returns ``model``. Inputs are then the CP rank's shard:
    ``input_ids`` / ``position_ids`` ``(batch, S / cp_size)`` (see ``RingDataCollator``).
    """
    if _transformers_version() < MIN_TRANSFORMERS:
        import transformers

        raise RuntimeError(
            f"ringft needs transformers >= 5.0 (AttentionInterface routing), found "
            f"{transformers.__version__}: pip install -U 'transformers>=5,<6'"
        )
    pretrained = pretrained_model(model)
    config = getattr(pretrained, "config", None)
    model_type = getattr(config, "model_type", None)
    attn_modules = _attention_modules(model)
    if config is None or not attn_modules:
        raise ValueError(
            f"{type(model).__name__} is not a transformers model with LLaMA-style attention; "
            f"supported: {', '.join(TESTED_MODEL_TYPES)} (LlamaForCausalLM, MistralForCausalLM and "
            "their base models)"
        )
    if model_type not in TESTED_MODEL_TYPES and not allow_untested:
        raise ValueError(
            f"model type {model_type!r} is not supported by ringft; supported: "
            f"{', '.join(TESTED_MODEL_TYPES)}. Other models whose attention goes through "
            "transformers' AttentionInterface may work: pass allow_untested=True and compare against a "
            "one-process run"
        )
    rank, size = group_rank_and_size(cp_group)
    rope = rope_problem(config, size)
    if rope:
        raise ValueError(rope)
    _register()
    old = ring_spec(model)
    hook = getattr(pretrained, "_ringft_hook", None)
    if hook is not None:
        hook.remove()
    previous = old.previous_implementation if old else config._attn_implementation
    spec = RingSpec(group=cp_group, backend=backend, size=size, rank=rank, previous_implementation=previous)
    pretrained._ringft_hook = decoder(model).register_forward_pre_hook(
        _input_check_hook(spec, config), with_kwargs=True
    )
    pretrained._ringft_ring = spec
    for module in attn_modules:
        module._ringft_ring = spec
    pretrained.set_attn_implementation(ATTENTION_NAME)
    return model


def remove_ring_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_ring_attention`: restore the previous attention implementation."""
    pretrained = pretrained_model(model)
    spec = ring_spec(model)
    if spec is None:
        return model
    pretrained._ringft_hook.remove()
    for module in _attention_modules(model):
        module.__dict__.pop("_ringft_ring", None)
    del pretrained._ringft_ring
    del pretrained._ringft_hook
    pretrained.set_attn_implementation(spec.previous_implementation or "sdpa")
    return model


@contextlib.contextmanager
def ring_attention(model: torch.nn.Module, cp_group=None, backend: str = "auto"):
    """Context manager form: ``with ring_attention(model, group): ...``."""
    apply_ring_attention(model, cp_group, backend)
    try:
        yield model
    finally:
        remove_ring_attention(model)
