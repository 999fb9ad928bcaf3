"""transformers integration: run LLaMA / Mistral attention as zigzag ring attention.

transformers (>= 5) routes the attention of LLaMA-style models through its ``AttentionInterface``
registry: the attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
q ``(batch, heads_q, seq_local, head_dim)`` and k/v ``(batch, heads_kv, seq_local, head_dim)``
(RoPE applied, GQA not expanded). :func:`apply_ring_attention` registers the ring under the plain
name ``zigzag_ring`` (names containing "flash", "sdpa", "flex" or "/" trigger other code paths in
transformers) and switches the model to it: this is ringft's "monkey-patch" of the
flash-attention forward, done through the route transformers offers instead of replacing classes.

No mask function is registered, so transformers hands the attention ``attention_mask=None``; a
forward pre-hook therefore refuses padding masks up front (they would otherwise be dropped) and
insists on the global position ids that RoPE needs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringft.modeling import decoder, pretrained_model
from ringft.ops import zigzag_ring_attention
from ringft.ops.comm import group_rank_and_size

ATTENTION_NAME = "zigzag_ring"
TESTED_MODEL_TYPES = ("llama", "mistral")
MIN_TRANSFORMERS = (5, 0)


@dataclass
class RingSpec:
    """What the patched attention needs: the CP group and the block backend."""

    group: Any
    backend: str
    size: int
    previous_implementation: str | None
    hook: Any = None
    rank: int = 0
    # Inference (ringft.inference): "ring" = train/forward; "prefill" = ring + keep the local K/V
    # of the positions in ``keep_local``; "decode" = new tokens against the sharded KV cache.
    mode: str = "ring"
    keep_local: torch.Tensor | None = None
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``zigzag_ring`` in transformers' ``AttentionInterface``.

    Takes q ``(B, Hq, S_local, D)``, k/v ``(B, Hkv, S_local, D)``; returns
    ``((B, S_local, Hq, D) contiguous, None)``.
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
    if spec.mode == "decode":
        return _decode_attention(module, spec, query, key, value, scaling), None
    global_len = query.shape[2] * spec.size
    if sliding_window is not None and global_len > sliding_window:
        raise ValueError(
            f"the model has sliding_window={sliding_window} but the sequence has {global_len} tokens: "
            "ring attention computes full causal attention and would silently ignore the window. "
            "Set model.config.sliding_window = None (as Mistral v0.2+ does for long context) or use "
            f"sequences of at most {sliding_window} tokens"
        )
    out = zigzag_ring_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=getattr(module, "is_causal", True),
        softmax_scale=scaling,
        group=spec.group,
        backend=spec.backend,
    )
    if spec.mode == "prefill":
        keep = spec.keep_local
        spec.cache[module.layer_idx] = (
            key.transpose(1, 2)[:, keep].contiguous(),
            value.transpose(1, 2)[:, keep].contiguous(),
        )
    return out.contiguous(), None


def _decode_attention(module, spec: RingSpec, query, key, value, scaling) -> torch.Tensor:
    """One new token per sequence: rank 0 appends its K/V to its cache part, all ranks attend."""
    from ringft.ops.decode import sharded_cache_attention

    if query.shape[2] != 1:
        raise ValueError("decode mode takes one new token at a time")
    k_cache, v_cache = spec.cache[module.layer_idx]
    if spec.rank == 0:  # the generated tokens live on CP rank 0 (counted once)
        k_cache = torch.cat([k_cache, key.transpose(1, 2)], dim=1)
        v_cache = torch.cat([v_cache, value.transpose(1, 2)], dim=1)
        spec.cache[module.layer_idx] = (k_cache, v_cache)
    out = sharded_cache_attention(
        query.transpose(1, 2),
        k_cache,
        v_cache,
        softmax_scale=scaling,
        group=spec.group,
        backend=spec.backend,
    )
    return out.contiguous()


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "layer_idx")
    ]


def _input_check_hook(spec: RingSpec):
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
            raise ValueError(
                "zigzag ring attention does not support padding attention masks (the mask would be "
                "dropped): right-pad with RingDataCollator and drop attention_mask from the batch"
            )
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = None  # an all-ones 2-D mask means "no padding"
        if (spec.size > 1 or spec.mode == "decode") and kwargs.get("position_ids") is None:
            raise ValueError(
                "ring attention over a CP group needs the global position ids of the local tokens "
                "(RoPE): pass position_ids from RingDataCollator or zigzag_position_ids(...)"
            )
        if kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False
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
    Works on a peft-wrapped model too. Returns ``model``.
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
    _register()
    rank, size = group_rank_and_size(cp_group)
    old: RingSpec | None = getattr(pretrained, "_ringft_ring", None)
    if old is not None:
        old.hook.remove()
    previous = old.previous_implementation if old else config._attn_implementation
    spec = RingSpec(group=cp_group, backend=backend, size=size, previous_implementation=previous, rank=rank)
    spec.hook = decoder(model).register_forward_pre_hook(_input_check_hook(spec), with_kwargs=True)
    pretrained._ringft_ring = spec
    for module in attn_modules:
        module._ringft_ring = spec
    pretrained.set_attn_implementation(ATTENTION_NAME)
    return model


def remove_ring_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_ring_attention`: restore the previous attention implementation."""
    pretrained = pretrained_model(model)
    spec: RingSpec | None = getattr(pretrained, "_ringft_ring", None)
    if spec is None:
        return model
    spec.hook.remove()
    for module in _attention_modules(model):
        module.__dict__.pop("_ringft_ring", None)
    del pretrained._ringft_ring
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
