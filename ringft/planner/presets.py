"""Model presets for the planner: published configs as transformers config dicts (no download).

Each entry names its source. Only the sizes memory depends on, plus the window / RoPE facts a
reader checks against the model card; a sliding window changes the attention FLOPs, not the
memory plan (every rank still keeps the K/V of all its local tokens for the backward).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "PRESET_ALIASES"]

#: Model shapes as transformers config dicts (hub configs cannot be downloaded everywhere).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    },
    "mistral-7b": {  # v0.3 shape: 32768 vocabulary, no sliding window
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "rms_norm_eps": 1e-5,
    },
    # Qwen/Qwen2.5-7B config.json (Hugging Face hub, transformers_version 4.40.1): q/k/v bias,
    # use_sliding_window false (sliding_window 131072 unused), 131072 positions, rope_theta 1e6.
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "use_sliding_window": False,
        "sliding_window": 131072,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
    },
    # Qwen/Qwen3-8B config.json (transformers_version 4.51.0): head_dim 128 (32 heads x 128 = 4096),
    # per-head q/k RMSNorm, no bias, no window, 40960 positions (YaRN factor 4 for 131072 in its card).
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
    },
    # google/gemma-3-4b-pt config.json, its text_config (the text decoder; the SigLIP vision tower is
    # not counted): head_dim 256 != 2560 / 8, query_pre_attn_scalar 256, window 1024 on 5 of every 6
    # layers (local RoPE base 1e4), global layers rope_theta 1e6 with linear scaling 8, 131072 positions.
    "gemma-3-4b": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262208,
        "tie_word_embeddings": True,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
    },
    # google/gemma-3-12b-pt config.json, its text_config (as gemma-3-4b; 48 layers, 16 / 8 heads).
    "gemma-3-12b": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262208,
        "tie_word_embeddings": True,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
    },
}
PRESET_ALIASES = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/llama-3.1-8b": "llama-3-8b",
    "llama-3.1-8b": "llama-3-8b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistral-7b-v0.3": "mistral-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen3-8b": "qwen3-8b",
    "google/gemma-3-4b-pt": "gemma-3-4b",
    "google/gemma-3-4b-it": "gemma-3-4b",
    "google/gemma-3-12b-pt": "gemma-3-12b",
    "google/gemma-3-12b-it": "gemma-3-12b",
}
