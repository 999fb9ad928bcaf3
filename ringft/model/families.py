"""The model families ringft runs on the ring, and the features it refuses.

Every supported family reaches attention through transformers' ``AttentionInterface``; what differs
is what arrives there (read from each modeling file of transformers 5.24):

- every family passes ``scaling=module.scaling`` (Gemma 3: ``query_pre_attn_scalar ** -0.5``, not
  ``head_dim ** -0.5``) and ``dropout`` (0 in eval, ``attention_dropout`` in training);
- q/k RMSNorm (Qwen3, Gemma 3: per head; OLMo 2: over all heads), q/k/v bias (Qwen2), a fused
  ``qkv_proj`` (Phi-3) and ``head_dim != hidden / heads`` (Gemma 3, Qwen3) all happen before the
  call, per token, so they are exact under sharding;
- the window arrives as the ``sliding_window`` keyword, per layer: Mistral and Phi-3 pass
  ``config.sliding_window`` on every layer; Qwen2 / Qwen3 / Gemma 3 pass it only on layers whose
  ``config.layer_types`` entry is ``"sliding_attention"`` (Qwen2/3 derive ``layer_types`` from
  ``use_sliding_window`` and ``max_window_layers``: layers ``i >= max_window_layers``; Gemma 3 from
  its 5-local-1-global pattern), others get ``None``. transformers' mask lets a query see the keys
  ``q - window < k <= q``;
- Gemma 3's local layers rotate with their own RoPE base (``rope_parameters["sliding_attention"]``),
  computed from the global position ids, so they are exact under zigzag sharding too;
- Gemma 4: each layer's own head dim (``head_dim`` local, ``global_head_dim`` global) reaches its
  own ring call; a layer of the last ``num_kv_shared_layers`` takes the K/V that the last earlier
  layer of its type stored (``shared_kv_states``): on the ring that is the rank's local shard, RoPE'd
  at the global positions, which is what the ring needs, and autograd sums both layers' dK/dV into
  it; ``attention_k_eq_v`` (V from the K projection) and ``hidden_size_per_layer_input`` are per
  token.

Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next text models: ``linear=True``): their
``linear_attention`` layers bypass the attention interface and run on the ring through
:mod:`ringft.model.gated_deltanet`; their full-attention layers (q/k RMSNorm per head, an output
gate, partial RoPE: all per token) go through the ring as every family's.

gpt-oss's attention sinks arrive as ``s_aux`` (one logit per query head) and are merged after the
ring (:mod:`ringft.ops.sinks`). Refused, because the ring cannot compute them exactly:
attention-logit soft-capping (Gemma 2), a final-logit soft-cap (the chunked loss and RingInference
project with the bare ``lm_head``), bidirectional / non-causal layers, chunked-attention or
non-attention layer types (linear-attention layers outside the hybrids above). Unknown model types
need ``allow_untested=True``; the refusals hold for them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ringft.model.chunked import chunk_problem
from ringft.model.family_table import FAMILIES, Family

if TYPE_CHECKING:  # no torch import at run time: the planner reads the table too
    from torch import nn

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "attention_modules",
    "call_problem",
    "check_model",
    "family_of",
    "global_rope",
    "layer_windows",
    "set_window",
    "unsupported_features",
]


SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_LAYER_TYPES = ("full_attention", "sliding_attention")


def family_of(config: Any) -> Family | None:
    """The :class:`Family` of a transformers config or config dict (by ``model_type``), None if
    unsupported."""
    model_type = (
        config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    )
    return FAMILIES.get(model_type)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` (peft-wrapped or not), in layer order: the modules that
    call transformers' attention interface, recognised by what they hand it (``scaling``,
    ``is_causal``) and their ``layer_idx`` -- not by projection names, which differ (``qkv_proj``)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "scaling") and hasattr(m, "is_causal")
    ]


def layer_windows(config: Any) -> list[int | None]:
    """The ``sliding_window`` each decoder layer's attention gets (None: full causal attention),
    for a supported family, following transformers' modeling code (see the module docstring).
    ``config``: a transformers config, or a dict of a config after its ``__post_init__`` (Qwen2's
    ``layer_types`` already derived)."""
    get = (
        config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    )
    fam = family_of(config)
    layers = int(get("num_hidden_layers"))
    window = get("sliding_window")
    if fam is None or fam.windows == "none" or window is None:
        return [None] * layers
    if fam.windows == "every_layer":
        if isinstance(config, Mapping) and fam.model_type == "qwen3_moe" and not get("use_sliding_window"):
            return [None] * layers  # Qwen3MoeConfig drops the window unless use_sliding_window
        return [window] * layers
    kinds = get("layer_types")
    if not kinds and fam.model_type in ("qwen2", "qwen3"):  # a config.json dict: Qwen2Config's rule
        start = get("max_window_layers", layers) if get("use_sliding_window", False) else layers
        kinds = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if not kinds and fam.model_type in ("gemma3_text", "gemma4_text"):  # their rule: 5 local, 1 global
        pattern = get("sliding_window_pattern", 6)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if fam.model_type == "gemma4_text":
            kinds[-1] = "full_attention"  # Gemma4TextConfig makes the last layer global
    if not kinds and fam.model_type == "olmo3":  # Olmo3Config's rule: 3 sliding, 1 full
        kinds = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    if fam.model_type == "smollm3" and not get("use_sliding_window", False):
        return [None] * layers  # SmolLM3's attention passes a window only when use_sliding_window
    if not kinds and fam.model_type == "smollm3":  # SmolLM3Config's rule: windows on the NoPE layers
        interval = get("no_rope_layer_interval", 4)
        rope = get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        kinds = ["full_attention" if r else "sliding_attention" for r in rope]
    kinds = list(kinds or ["full_attention"] * layers)
    return [window if kind == "sliding_attention" else None for kind in kinds]


def _layer_type_problem(config: Any) -> str | None:
    kinds = getattr(config, "layer_types", None) or []
    fam = family_of(config)
    allowed = (*_LAYER_TYPES, "linear_attention") if fam is not None and fam.linear else _LAYER_TYPES
    allowed = (*allowed, "chunked_attention") if fam is not None and fam.chunked else allowed
    odd = sorted({k for k in kinds if k not in allowed})
    if odd:
        return (
            f"layer_types {odd} (only full_attention and sliding_attention layers run on the ring; "
            "chunked or linear-attention layers are not supported, but the Gated DeltaNet layers of "
            "qwen3_5_text, qwen3_5_moe_text and qwen3_next and the chunked layers of llama4_text)"
        )
    return None


def unsupported_features(config: Any, modules: list[nn.Module]) -> list[str]:
    """The features of ``config`` / its attention ``modules`` that ring attention cannot compute
    exactly, each named with the config key or module attribute that asks for it."""
    found = []
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        found.append(f"attention-logit soft-capping (config.attn_logit_softcapping={softcap})")
    final = getattr(config, "final_logit_softcapping", None)
    if final is not None:
        found.append(
            f"final-logit soft-capping (config.final_logit_softcapping={final}; ringft's chunked loss and "
            "RingInference project with the lm_head alone)"
        )
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    if getattr(config, "model_type", None) == "gemma4_text" and bidirectional == "vision":
        bidirectional = False  # only Gemma 4's multimodal model reads it (its image tokens)
    if bidirectional or any(not m.is_causal for m in modules):
        found.append("bidirectional (non-causal) attention layers (config.use_bidirectional_attention)")
    chunk = getattr(config, "attention_chunk_size", None)
    fam = family_of(config)
    if chunk is not None and not (fam is not None and fam.chunked):
        found.append(f"chunked attention (config.attention_chunk_size={chunk})")
    elif fam is not None and fam.chunked:
        found += [p for p in [chunk_problem(config)] if p]
    layer_problem = _layer_type_problem(config)
    if layer_problem:
        found.append(layer_problem)
    return found


def _unsupported_type_message(model_type: Any) -> str:
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        text = model_type + "_text"
        return (
            f"model type {model_type!r} (text + vision) is not supported by ringft: train its text decoder "
            f"(the *ForCausalLM of model type {text}); supported: {supported}"
        )
    if model_type == "llama4":
        return (
            "model type 'llama4' (Llama4ForConditionalGeneration: text + vision) is not supported by "
            "ringft: train its text decoder as Llama4ForCausalLM (model type llama4_text, the "
            f"checkpoint's text_config); supported: {supported}"
        )
    if model_type == "gemma3":
        return (
            "model type 'gemma3' (Gemma3ForConditionalGeneration: text + vision) is not supported by "
            "ringft: train its text decoder as Gemma3ForCausalLM (model type gemma3_text, e.g. the "
            f"270M / 1B checkpoints or a text-only export); supported: {supported}"
        )
    return (
        f"model type {model_type!r} is not supported by ringft; supported: {supported}. Other models "
        "whose attention goes through transformers' AttentionInterface may work: pass "
        "allow_untested=True and compare against a one-process run"
    )


def check_model(config: Any, modules: list[nn.Module], allow_untested: bool = False) -> None:
    """Refuse (``ValueError``, one line naming the feature and the fix) a model the ring cannot run
    exactly: an unsupported ``model_type`` without ``allow_untested``, no attention modules, a
    supported family whose attention modules were not all found, or :func:`unsupported_features`."""
    model_type = getattr(config, "model_type", None)
    fam = family_of(config)
    if fam is None and not allow_untested:
        raise ValueError(_unsupported_type_message(model_type))
    if not modules:
        raise ValueError(
            f"found no attention modules (modules with layer_idx, scaling and is_causal) in this "
            f"{model_type!r} model: ringft supports decoders whose attention goes through transformers' "
            f"AttentionInterface ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if fam is not None and fam.linear and layers is not None:  # the Gated DeltaNet layers are counted apart
        layers -= list(getattr(config, "layer_types", None) or []).count("linear_attention")
    if fam is not None and layers is not None and len(modules) != layers:
        raise ValueError(
            f"found {len(modules)} attention modules in this {fam.label} model but config.num_hidden_layers "
            f"is {layers}: the model does not have the structure of transformers' {fam.classes[0]}"
        )
    features = unsupported_features(config, modules)
    if features:
        raise ValueError(
            f"ring attention cannot run this {model_type!r} model exactly: it uses "
            + "; ".join(features)
            + ". Use a model without these features (or set the config value to None where that is the "
            "model you want)"
        )


def call_problem(kwargs: Mapping[str, Any]) -> str | None:
    """What an attention call asks for that the ring cannot do (``softcap``), or None. Checked on
    every call: a model of an untested family may pass it."""
    if kwargs.get("softcap") is not None:
        return (
            f"the attention call asks for logit soft-capping (softcap={kwargs['softcap']}), which zigzag "
            "ring attention does not compute: this model is not supported"
        )
    return None


def global_rope(params: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters a theta raise or a RoPE scaling applies to: ``params`` itself, or for a
    model with RoPE per layer type (Gemma 3: ``{"full_attention": ..., "sliding_attention": ...}``)
    the global layers' entry. Local (sliding-window) layers keep theirs: they never see a distance
    beyond the window, which is how Gemma 3 itself was extended to 128K (global layers only)."""
    nested = params and all(isinstance(v, dict) for v in params.values())
    if nested and "full_attention" in params:
        return params["full_attention"]
    return params


def set_window(config: Any, window: int | None) -> None:
    """Set the sliding window of a supported family's layers that have one (``None``: none, full
    attention on every layer), or raise ``ValueError`` naming why that model cannot have it."""
    fam = family_of(config)
    name = fam.label if fam else repr(getattr(config, "model_type", None))
    if fam is None or fam.windows == "none":
        if window is None:
            return
        raise ValueError(f"{name} has no sliding-window attention: use model.sliding_window: keep")
    if fam.windows == "every_layer":
        config.sliding_window = window
        if hasattr(config, "use_sliding_window"):  # Qwen3-MoE
            config.use_sliding_window = window is not None
        return
    kinds = list(getattr(config, "layer_types", None) or [])
    if fam.model_type in ("gemma3_text", "gemma4_text"):
        if window is None:
            raise ValueError(
                f"Gemma {fam.model_type[5]}'s local layers were trained with a sliding window (and their own "
                "RoPE base): "
                "model.sliding_window must be keep or a window size, not null"
            )
        config.sliding_window = window
        return
    if window is None:  # Qwen2 / Qwen3: as use_sliding_window false
        config.sliding_window = None
        config.use_sliding_window = False
        config.layer_types = ["full_attention"] * len(kinds)
        return
    if "sliding_attention" not in kinds:
        raise ValueError(
            f"no layer of this {name} config is a sliding-window layer (use_sliding_window: false, or "
            "max_window_layers >= num_hidden_layers), so model.sliding_window would change nothing: "
            "use keep, or a config with use_sliding_window: true"
        )
    config.sliding_window = window
