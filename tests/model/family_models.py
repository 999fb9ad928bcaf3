"""Tiny random models of every supported family, for the ring-vs-transformers tests.

Each entry of :data:`FAMILY_CONFIGS` is ``(model_type, config kwargs)`` exercising what the family
hands (or does around) the attention call: Llama 3.1's ``llama3`` RoPE (LLaMA), q/k/v bias (Qwen2),
YaRN (Qwen2.5's long-context config), per-head q/k norm and ``head_dim != hidden / heads`` (Qwen3),
``query_pre_attn_scalar``, head_dim 32 with hidden 64 / 4 heads, local and global layers with their
own RoPE bases and linear scaling on the global layers (Gemma 3, as its 4B/12B configs), a fused
``qkv_proj`` (Phi-3), q/k norm over all heads (OLMo 2).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.tiny_models import TINY

VOCAB = TINY["vocab_size"]
COMMON = {**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # tiny_model's config
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        {
            "rope_parameters": {  # Llama 3.1's RoPE type, with a short original length so it bites
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500_000.0,
            }
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        },
    ),
    "qwen3": ("qwen3", {"head_dim": 24}),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 20,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 4096,
            "rope_parameters": GEMMA3_ROPE,
        },
    ),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
}
# Windows per family: the layers that get the window, as transformers' modeling code passes it.
WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),  # layer 1 windowed
    "qwen3": ("qwen3", {"head_dim": 24, "use_sliding_window": True, "max_window_layers": 1}),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 20,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": GEMMA3_ROPE,
        },
    ),
}


def tiny_family(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any):
    """A random ``*ForCausalLM`` of ``model_type`` (2 layers, hidden 64, 4 query / 2 KV heads), eager
    attention, in ``dtype``, eval mode (no dropout anywhere)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def family_model(name: str, dtype: torch.dtype = torch.float64, **overrides: Any):
    """:func:`tiny_family` of the :data:`FAMILY_CONFIGS` entry ``name``."""
    model_type, kwargs = FAMILY_CONFIGS[name]
    return tiny_family(model_type, dtype, **{**kwargs, **overrides})


def windowed_model(name: str, window: int, dtype: torch.dtype = torch.float64, **overrides: Any):
    """:func:`tiny_family` of the :data:`WINDOWED` entry ``name`` with ``sliding_window=window``."""
    model_type, kwargs = WINDOWED[name]
    return tiny_family(model_type, dtype, **{**kwargs, "sliding_window": window, **overrides})
