"""Tiny random models of every supported family, for the ring-vs-transformers tests.

Each entry of :data:`FAMILY_CONFIGS` is ``(model_type, config kwargs)`` exercising what the family
hands (or does around) the attention call: Llama 3.1's ``llama3`` RoPE (LLaMA), q/k/v bias (Qwen2),
YaRN (Qwen2.5's long-context config), per-head q/k norm and ``head_dim != hidden / heads`` (Qwen3),
``query_pre_attn_scalar``, head_dim 32 with hidden 64 / 4 heads, local and global layers with their
own RoPE bases and linear scaling on the global layers (Gemma 3, as its 4B/12B configs), a fused
``qkv_proj`` (Phi-3), q/k norm over all heads (OLMo 2), a sparse MoE MLP (Qwen3-MoE; Mixtral with
a window), attention sinks with sliding + full layers (gpt-oss), sliding + full layers (OLMo 3), a
windowed NoPE layer (SmolLM3), queries scaled by their position (Ministral 3), chunked local
attention with a NoPE layer's query temperature (Llama 4), per-layer head dims, layers reusing
an earlier layer's K/V and V = K on the global layers (Gemma 4).
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
# Ministral 3 scales its queries by 1 + beta * log(1 + floor(position / original)): a short
# original length so the scale changes inside the tiny sequences.
MINISTRAL3_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000.0,
    "llama_4_scaling_beta": 0.5,
    "original_max_position_embeddings": 8,
}
MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}  # 4 experts, 2 per token
# Gemma 4's sizes at the tiny scale (its defaults: head dims 256 / 512, per-layer inputs of 256 over a
# 262144-token vocabulary); the per-layer inputs (a per-token residual) are on.
GEMMA4 = {
    "gemma4_text": {
        "head_dim": 16,
        "global_head_dim": 32,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
    }
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
                "factor": 64.0,  # max_position_embeddings / original
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
    "deepseek_v3": (  # latent attention: q/k head dim 16 + 8, v head dim 12; 1 dense + 1 MoE layer
        "deepseek_v3",
        {
            "num_key_value_heads": 4,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            **MOE,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
        },
    ),
    # Llama 4: chunked layers 0 and 2 (chunks of 5 tokens: on no zigzag chunk edge), a NoPE layer 1
    # whose query temperature changes every 4 positions, MoE (shared expert) on layer 1
    "llama4": (
        "llama4_text",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "attention_chunk_size": 5,
            "no_rope_layers": [1, 0, 1],
            "floor_scale": 4,
            "attn_scale": 0.5,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 64,
            "interleave_moe_layer_step": 2,
        },
    ),
    # Mistral 4: DeepSeek-V3's latent attention (q/k 16 + 8, v 12) with Ministral 3's query scaling
    "mistral4": (
        "mistral4",
        {
            "num_key_value_heads": 4,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            **MOE,
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "rope_parameters": {  # YaRN (the default RoPE type ignores partial_rotary_factor)
                **MINISTRAL3_ROPE,
                "rope_type": "yarn",
                "factor": 64.0,  # max_position_embeddings / original
                "partial_rotary_factor": 8 / 24,
            },
        },
    ),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 24, **MOE, "num_experts": 4, "moe_intermediate_size": 32}),
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
    "olmo3": ("olmo3", {"layer_types": ["sliding_attention", "full_attention"]}),
    # layer 1 is a NoPE layer, and SmolLM3 windows only its NoPE layers
    "smollm3": ("smollm3", {"use_sliding_window": True, "no_rope_layer_interval": 2}),
    "ministral3": ("ministral3", {"rope_parameters": MINISTRAL3_ROPE}),
    # Gemma 4: local head dim 16, global 32 with 1 KV head and V from the K projection
    # (attention_k_eq_v); layers 2 and 3 reuse the K/V of layers 0 and 1 (num_kv_shared_layers)
    "gemma4": (
        "gemma4_text",
        {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
        },
    ),
    "mixtral": ("mixtral", {**MOE, "num_local_experts": 4}),
    "gpt_oss": (
        "gpt_oss",
        {
            **MOE,
            "num_local_experts": 4,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
}


def tiny_family(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any):
    """A random ``*ForCausalLM`` of ``model_type`` (2 layers, hidden 64, 4 query / 2 KV heads), eager
    attention, in ``dtype``, eval mode (no dropout anywhere)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **GEMMA4.get(model_type, {}), **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    if model_type == "mistral4":  # (not registered with AutoModelForCausalLM in transformers 5.24)
        from transformers import Mistral4ForCausalLM

        model = Mistral4ForCausalLM._from_config(config, dtype=dtype, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    if is_moe(model):
        model.set_experts_implementation("eager")  # the grouped kernels have no fp64 on CPU
    return model.eval()


def is_moe(model) -> bool:
    """Whether ``model`` has a sparse mixture-of-experts MLP."""
    from ringft.model.families import family_of

    fam = family_of(model.config)
    return bool(fam and fam.moe)


def family_model(name: str, dtype: torch.dtype = torch.float64, **overrides: Any):
    """:func:`tiny_family` of the :data:`FAMILY_CONFIGS` entry ``name``."""
    model_type, kwargs = FAMILY_CONFIGS[name]
    return tiny_family(model_type, dtype, **{**kwargs, **overrides})


def windowed_model(name: str, window: int, dtype: torch.dtype = torch.float64, **overrides: Any):
    """:func:`tiny_family` of the :data:`WINDOWED` entry ``name`` with ``sliding_window=window``."""
    model_type, kwargs = WINDOWED[name]
    return tiny_family(model_type, dtype, **{**kwargs, "sliding_window": window, **overrides})
