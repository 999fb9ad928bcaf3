"""The table of supported model families (:data:`FAMILIES`), read by :mod:`ringft.model.families`
(what the ring accepts) and the planner (shape facts). No torch import."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family"]


@dataclass(frozen=True)
class Family:
    """One supported model family: its ``model_type``, its transformers classes, where its sliding
    windows come from (``"none"``, ``"every_layer"``: ``config.sliding_window`` on each layer,
    ``"layer_types"``: on the layers ``config.layer_types`` marks ``"sliding_attention"``), the
    names of its attention projections (LoRA targets) and what reaches or surrounds attention.

    Shape facts for the planner: ``qk_norm`` ``""`` / ``"head"`` (an RMSNorm over each head's
    ``head_dim``) / ``"all"`` (over all heads' q or k, OLMo 2); ``qkv_bias`` (q/k/v projections
    with bias, o_proj without: Qwen2); ``norms`` RMSNorms per decoder layer (Gemma 3: 4);
    ``fused`` (Phi-3's ``qkv_proj`` and ``gate_up_proj``); ``moe`` (a sparse mixture-of-experts MLP
    with a router: its load-balancing loss is a statistic of the whole batch); ``linear``: Gated
    DeltaNet layers where ``config.layer_types`` says ``"linear_attention"``; ``chunked``: local
    attention within ``attention_chunk_size`` tokens where ``config.layer_types`` says
    ``"chunked_attention"`` (Llama 4; :mod:`ringft.model.chunked`)."""

    model_type: str
    label: str
    classes: tuple[str, ...]
    windows: str
    attention_projections: tuple[str, ...]
    notes: str
    qk_norm: str = ""
    qkv_bias: bool = False
    norms: int = 2
    fused: bool = False
    moe: bool = False
    linear: bool = False
    chunked: bool = False


_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LLaMA 2 / 3.x", ("LlamaForCausalLM", "LlamaModel"), "none", _QKVO, "GQA"),
        Family(
            "mistral",
            "Mistral",
            ("MistralForCausalLM", "MistralModel"),
            "every_layer",
            _QKVO,
            "GQA; sliding_window on every layer",
        ),
        Family(
            "qwen2",
            "Qwen2 / Qwen2.5",
            ("Qwen2ForCausalLM", "Qwen2Model"),
            "layer_types",
            _QKVO,
            "q/k/v bias; windows on layers >= max_window_layers when use_sliding_window",
            qkv_bias=True,
        ),
        Family(
            "qwen3",
            "Qwen3",
            ("Qwen3ForCausalLM", "Qwen3Model"),
            "layer_types",
            _QKVO,
            "per-head q/k RMSNorm; head_dim != hidden/heads; windows as Qwen2",
            qk_norm="head",
        ),
        Family(
            "gemma3_text",
            "Gemma 3 (text)",
            ("Gemma3ForCausalLM", "Gemma3TextModel"),
            "layer_types",
            _QKVO,
            "per-head q/k RMSNorm; scale query_pre_attn_scalar^-0.5; head_dim 256; local (sliding, own "
            "RoPE base) and global layers per layer_types",
            qk_norm="head",
            norms=4,
        ),
        Family(
            "gemma4_text",
            "Gemma 4 (text)",
            ("Gemma4ForCausalLM", "Gemma4TextModel"),
            "layer_types",
            _QKVO,
            "per-layer head dims (head_dim local, global_head_dim global: each layer's own ring call); "
            "layers reusing an earlier layer's K/V (num_kv_shared_layers: that layer's local shard, as the "
            "ring needs it); attention_k_eq_v; scale 1; local (sliding) and global layers per layer_types",
            qk_norm="head",
            norms=4,
        ),
        Family(
            "phi3",
            "Phi-3",
            ("Phi3ForCausalLM", "Phi3Model"),
            "every_layer",
            ("qkv_proj", "o_proj"),
            "fused qkv_proj; sliding_window on every layer",
            fused=True,
        ),
        Family(
            "olmo2",
            "OLMo 2",
            ("Olmo2ForCausalLM", "Olmo2Model"),
            "none",
            _QKVO,
            "q/k RMSNorm over all heads; post-norms",
            qk_norm="all",
        ),
        Family(
            "olmo3",
            "OLMo 3",
            ("Olmo3ForCausalLM", "Olmo3Model"),
            "layer_types",
            _QKVO,
            "q/k RMSNorm over all heads; post-norms; sliding and full layers per layer_types",
            qk_norm="all",
        ),
        Family(
            "smollm3",
            "SmolLM3",
            ("SmolLM3ForCausalLM", "SmolLM3Model"),
            "layer_types",
            _QKVO,
            "GQA; NoPE layers (no_rope_layers); windows on sliding layers when use_sliding_window",
        ),
        Family(
            "ministral3",
            "Ministral 3",
            ("Ministral3ForCausalLM", "Ministral3Model"),
            "every_layer",
            _QKVO,
            "GQA; queries scaled by position (llama_4_scaling_beta, from the global position ids); "
            "sliding_window on every layer",
        ),
        Family(
            "mixtral",
            "Mixtral",
            ("MixtralForCausalLM", "MixtralModel"),
            "every_layer",
            _QKVO,
            "GQA; sparse MoE MLP (per token); sliding_window on every layer",
            moe=True,
        ),
        Family(
            "qwen3_moe",
            "Qwen3-MoE",
            ("Qwen3MoeForCausalLM", "Qwen3MoeModel"),
            "every_layer",
            _QKVO,
            "per-head q/k RMSNorm; sparse MoE MLP (per token); sliding_window on every layer when "
            "use_sliding_window",
            qk_norm="head",
            moe=True,
        ),
        Family(
            "deepseek_v3",
            "DeepSeek-V3",
            ("DeepseekV3ForCausalLM", "DeepseekV3Model"),
            "none",
            ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
            "latent attention: q/k head dim (nope + rope) != v head dim, K and V on the ring at own sizes "
            "(ringft.ops.latent); sparse MoE MLP (per token) after dense layers",
            moe=True,
        ),
        Family(
            "llama4_text",
            "Llama 4 (text)",
            ("Llama4ForCausalLM", "Llama4TextModel"),
            "none",
            _QKVO,
            "chunked local attention on the RoPE layers (attention_chunk_size: chunk pieces as packed "
            "documents); NoPE layers' query temperature from the global positions; L2 q/k norm (no weight); "
            "MoE with a shared expert (sigmoid router, no aux loss in transformers)",
            moe=True,
            chunked=True,
        ),
        Family(
            "mistral4",
            "Mistral 4",
            ("Mistral4ForCausalLM", "Mistral4Model"),
            "none",
            ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
            "latent attention as DeepSeek-V3's; queries scaled by position "
            "(llama_4_scaling_beta, from the global position ids); sparse MoE MLP (per token)",
            moe=True,
        ),
        Family(
            "gpt_oss",
            "gpt-oss",
            ("GptOssForCausalLM", "GptOssModel"),
            "layer_types",
            _QKVO,
            "attention sinks (a learned logit per head, merged after the ring: ringft.ops.sinks); "
            "q/k/v/o bias; sliding and full layers per layer_types; sparse MoE MLP (per token)",
            moe=True,
        ),
        *(
            Family(
                model_type,
                label,
                classes,
                "none",
                _QKVO,
                "Gated DeltaNet (linear_attention) layers with gated full-attention layers per layer_types; "
                "per-head q/k RMSNorm; partial RoPE" + extra,
                qk_norm="head",
                moe=bool(extra),
                linear=True,
            )
            for model_type, label, classes, extra in (
                ("qwen3_5_text", "Qwen3.5 (text)", ("Qwen3_5ForCausalLM", "Qwen3_5TextModel"), ""),
                (
                    "qwen3_5_moe_text",
                    "Qwen3.5-MoE (text)",
                    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel"),
                    "; sparse MoE MLP (per token)",
                ),
                (
                    "qwen3_next",
                    "Qwen3-Next",
                    ("Qwen3NextForCausalLM", "Qwen3NextModel"),
                    "; sparse MoE MLP (per token)",
                ),
            )
        ),
    )
}
