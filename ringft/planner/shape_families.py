"""Family facts of :class:`~ringft.planner.shapes.ModelShape` read from a config: MoE MLPs, latent
attention (DeepSeek-V3, Mistral 4), Gemma 4's per-layer attention, Gated DeltaNet layers (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next), and one layer's parameters by module (read from transformers 5.24's
modeling files; the tests check every count against the models themselves).

``get(key, default=None)`` reads the config (a dict of config.json keys or a ``PretrainedConfig``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["family_fields", "mixer_params", "mixer_shapes", "moe_fields"]

Get = Callable[..., Any]


def moe_fields(get: Get) -> tuple[int, int, int, dict[str, Any]]:
    """``(experts, expert width, per-token width, other ModelShape fields)`` of a MoE config; a
    Qwen3-MoE / Qwen3-Next config with dense layers (``mlp_only_layers``, ``decoder_sparse_step > 1``)
    is refused: not modelled. Llama 4: a shared expert of the expert width (counted in the per-token
    width), dense layers per ``moe_layers`` / ``interleave_moe_layer_step`` of width
    ``intermediate_size_mlp``; DeepSeek-V3 / Mistral 4: ``n_shared_experts`` shared experts and the
    first ``first_k_dense_replace`` layers dense (``intermediate_size``); Qwen3.5-MoE / Qwen3-Next:
    a shared expert with a sigmoid gate (``h x 1``); gpt-oss: biased experts and router."""
    if get("mlp_only_layers") or int(get("decoder_sparse_step") or 1) != 1:
        raise ValueError("the planner models MoE configs whose every layer is sparse (mlp_only_layers: [])")
    kind = get("model_type")
    experts = int(get("num_experts") or get("num_local_experts") or get("n_routed_experts"))
    width = int(get("moe_intermediate_size") or get("intermediate_size"))
    per_token = int(get("num_experts_per_tok") or get("experts_per_token")) * width
    extra: dict[str, Any] = {"expert_bias": kind == "gpt_oss"}
    layers = int(get("num_hidden_layers"))
    if kind == "llama4_text":
        step = int(get("interleave_moe_layer_step") or 1)
        moe = get("moe_layers")
        moe = list(range(step - 1, layers, step)) if moe is None else list(moe)  # Llama4TextConfig's rule
        extra.update(
            shared_expert_intermediate=width,
            dense_layers=tuple(i for i in range(layers) if i not in moe),
            dense_intermediate=int(get("intermediate_size_mlp") or 0),
        )
        per_token += width
    elif kind in ("deepseek_v3", "mistral4"):
        shared = width * int(get("n_shared_experts") or 0)
        dense = int(get("first_k_dense_replace") or 0)
        extra.update(
            shared_expert_intermediate=shared,
            dense_layers=tuple(range(min(dense, layers))),
            dense_intermediate=int(get("intermediate_size") or 0),
        )
        per_token += shared
    elif kind in ("qwen3_next", "qwen3_5_moe_text"):
        shared = int(get("shared_expert_intermediate_size") or 0)
        extra.update(shared_expert_intermediate=shared, shared_expert_gate=True)
        per_token += shared
    return experts, width, per_token, extra


def _latent(get: Get) -> dict[str, Any]:
    """DeepSeek-V3 / Mistral 4: q/k of ``qk_nope + qk_rope`` per head, V of ``v_head_dim``, K/V at
    every query head (``kv_b_proj`` makes ``num_attention_heads`` of each)."""
    nope, rope = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
    heads = int(get("num_attention_heads"))
    return {
        "head_dim": nope + rope,
        "kv_heads": heads,
        "v_head_dim": int(get("v_head_dim") or nope + rope),
        "q_lora_rank": int(get("q_lora_rank") or 0),
        "kv_lora_rank": int(get("kv_lora_rank")),
        "rope_head_dim": rope,
    }


def _gemma4(get: Get) -> dict[str, Any]:
    """Gemma 4 text: the global layers' head dim and K/V heads (``per_layer_config`` of a
    ``Gemma4TextConfig``, or ``global_head_dim`` / ``num_global_key_value_heads`` of a config.json),
    the last ``num_kv_shared_layers`` layers reusing K/V, V from the K projection on global layers
    (``attention_k_eq_v``), the double-wide MLP of the shared layers, the per-layer inputs."""
    if get("enable_moe_block"):
        raise ValueError("the planner does not model Gemma 4's MoE block (enable_moe_block) yet")
    per_layer = get("per_layer_config")
    k_eq_v = bool(get("attention_k_eq_v", False))
    global_dim, global_kv = int(get("global_head_dim") or 512), get("num_global_key_value_heads")
    global_kv = int(global_kv) if global_kv is not None and k_eq_v else None
    if per_layer is not None:  # overrides per global layer: one set for all of them
        items = per_layer.values() if isinstance(per_layer, Mapping) else list(per_layer)
        overrides = {
            (int(_read(o, "head_dim")), _read(o, "num_key_value_heads"))
            for o in items
            if _read(o, "head_dim") is not None and int(_read(o, "head_dim")) != int(get("head_dim"))
        }
        if len(overrides) > 1:
            raise ValueError(f"the planner models one global head dim for Gemma 4, got {sorted(overrides)}")
        if overrides:
            global_dim, kv = overrides.pop()
            global_kv = None if kv is None else int(kv)
    layers = int(get("num_hidden_layers"))
    kinds = list(get("layer_types") or [])
    if not kinds:  # Gemma4TextConfig's rule: 5 local, 1 global
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    kinds[-1] = "full_attention"  # Gemma4TextConfig makes the last layer global
    per_layer_input = int(get("hidden_size_per_layer_input") or 0)
    vocab = int(get("vocab_size_per_layer_input") or get("vocab_size")) if per_layer_input else 0
    return {
        "global_layers": tuple(i for i, k in enumerate(kinds) if k == "full_attention"),
        "global_head_dim": global_dim,
        "global_kv_heads": global_kv or 0,
        "kv_shared_layers": min(int(get("num_kv_shared_layers") or 0), layers),
        "k_eq_v": k_eq_v,
        "double_wide_mlp": bool(get("use_double_wide_mlp", False)),
        "per_layer_input": per_layer_input,
        "per_layer_vocab": vocab,
        "v_norm": True,
    }


def _read(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _linear(get: Get) -> dict[str, Any]:
    """Gated DeltaNet hybrids: the ``linear_attention`` layers (``layer_types``, or a full-attention
    layer every ``full_attention_interval``) and their sizes; full-attention layers with an output gate."""
    layers = int(get("num_hidden_layers"))
    kinds = get("layer_types")
    if not kinds:
        interval = int(get("full_attention_interval") or 4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    dims = tuple(
        int(get(k))
        for k in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    )
    return {
        "linear_layers": tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
        "linear_dims": dims,
        "attn_gate": True,
    }


def family_fields(get: Get, family: Any) -> dict[str, Any]:
    """The :class:`~ringft.planner.shapes.ModelShape` fields of the config's family beyond a
    LLaMA-style layer (empty for LLaMA-style families)."""
    kind = get("model_type")
    out: dict[str, Any] = {}
    if get("kv_lora_rank") is not None:
        out.update(_latent(get))
    if kind == "gemma4_text":
        out.update(_gemma4(get))
    if family is not None and family.linear:
        out.update(_linear(get))
    return out


def mixer_shapes(m: Any) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of the token mixer's projections of one layer view ``m``:
    a Gated DeltaNet layer's, latent attention's, or q/k/v/o (Phi-3: ``qkv_proj``; Qwen3.5's q_proj
    twice as wide for the output gate; no k/v on a layer reusing K/V, no v on Gemma 4's ``V = K``)."""
    h = m.hidden
    if m.mixer == "linear":
        nk, nv, dk, dv, _ = m.linear_dims
        key, value = nk * dk, nv * dv
        if m.model_type == "qwen3_next":
            return {
                "in_proj_qkvz": (h, 2 * key + 2 * value),
                "in_proj_ba": (h, 2 * nv),
                "out_proj": (value, h),
            }
        return {
            "in_proj_qkv": (h, 2 * key + value),
            "in_proj_z": (h, value),
            "in_proj_b": (h, nv),
            "in_proj_a": (h, nv),
            "out_proj": (value, h),
        }
    q, kv, out = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.heads * m.v_dim
    if m.kv_lora_rank:
        qr, kvr, nope = m.q_lora_rank, m.kv_lora_rank, m.head_dim - m.rope_head_dim
        shapes = {"q_a_proj": (h, qr), "q_b_proj": (qr, q)} if qr else {"q_proj": (h, q)}
        shapes["kv_a_proj_with_mqa"] = (h, kvr + m.rope_head_dim)
        shapes["kv_b_proj"] = (kvr, m.heads * (nope + m.v_dim))
        shapes["o_proj"] = (out, h)
        return shapes
    if m.fused:
        return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h)}
    shapes = {"q_proj": (h, q * (2 if m.attn_gate else 1))}
    if not m.kv_shared:
        shapes["k_proj"] = (h, kv)
        if not m.v_from_k:
            shapes["v_proj"] = (h, kv)
    shapes["o_proj"] = (out, h)
    return shapes


def mixer_params(m: Any) -> int:
    """The token mixer's parameters of one layer view beyond its projections: biases, q/k and latent
    norms, sinks, a Gated DeltaNet layer's convolution, decay, ``dt_bias`` and gated norm."""
    if m.mixer == "linear":
        nk, nv, dk, dv, kernel = m.linear_dims
        return (2 * nk * dk + nv * dv) * kernel + 2 * nv + dv
    n = m.heads if m.sinks else 0
    if m.kv_lora_rank:  # the latent norms; biases on q_a, kv_a and o
        n += m.q_lora_rank + m.kv_lora_rank
        if m.attention_bias:
            n += m.q_lora_rank + m.kv_lora_rank + m.rope_head_dim + m.hidden
        return n
    kv = 0 if m.kv_shared else (1 if m.v_from_k else 2) * m.kv_heads * m.head_dim
    if m.attention_bias:
        n += m.heads * m.head_dim + kv + m.hidden
    elif m.qkv_bias:
        n += m.heads * m.head_dim + kv
    return n + m.qk_norm_params
