"""Model shapes for the planner: the sizes of a decoder that memory depends on.

``h`` hidden size, ``i`` MLP intermediate size, ``L`` layers, ``nh`` attention heads, ``nkv``
key/value heads, ``d`` head dim (Gemma 3, Qwen3: not ``h / nh``), ``V`` vocabulary, and the family
facts of :data:`ringft.model.families.FAMILIES` (q/k norms, q/k/v bias, norms per layer, fused
projections). Read from presets (:data:`PRESETS`, no download), a config dict or
``PretrainedConfig`` (a multimodal config's ``text_config``), a config.json, or a model directory.
Sliding windows are recorded (``windows``) but change no memory term: a window lowers the attention
FLOPs, while every rank still keeps the K/V of all its local tokens for the backward.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ringft.model.families import FAMILIES, layer_windows
from ringft.planner.presets import PRESET_ALIASES, PRESETS

__all__ = ["DEFAULT_LORA_TARGETS", "PRESETS", "ModelShape", "load_model_shape"]

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The config keys the shape needs (num_key_value_heads and head_dim have defaults).
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that memory depends on (a LLaMA-style layer plus the family facts)."""

    name: str
    hidden: int  # h
    intermediate: int  # i
    layers: int  # L
    heads: int  # nh
    kv_heads: int  # nkv
    head_dim: int  # d
    vocab: int  # V
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False  # q/k/v projections with bias, o_proj without (Qwen2)
    qk_norm: str = ""  # "head": RMSNorm over each head (Qwen3, Gemma 3); "all": over all heads (OLMo 2)
    norms: int = 2  # RMSNorms per decoder layer (Gemma 3: 4)
    fused: bool = False  # qkv_proj and gate_up_proj (Phi-3)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full attention)
    # sparse MoE MLP (Mixtral, Qwen3-MoE): ``experts`` of width ``expert_intermediate`` each, a router
    # ``h x experts``; ``intermediate`` is then the per-token width, ``experts_per_token * width``
    experts: int = 0
    expert_intermediate: int = 0
    # Llama 4: a shared expert of this width beside the routed ones, and the layers with a dense MLP
    # of width ``dense_intermediate`` instead (interleave_moe_layer_step > 1); gpt-oss: biases on the
    # experts and the router (``expert_bias``) and one attention-sink logit per head (``sinks``)
    shared_expert_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()
    dense_intermediate: int = 0
    expert_bias: bool = False
    sinks: bool = False

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a transformers ``PretrainedConfig`` or a config dict (transformers key names); a
        multimodal config (Gemma 3 4B+) gives its ``text_config``."""
        get = (
            config.get if isinstance(config, Mapping) else lambda k, default=None: getattr(config, k, default)
        )
        text = get("text_config")
        if text is not None:
            text = dict(text) if isinstance(text, Mapping) else text
            if isinstance(text, dict):
                text.setdefault("model_type", f"{get('model_type')}_text")
            return cls.from_config(text, name=name or get("_name_or_path"))
        family = FAMILIES.get(get("model_type"))
        if get("model_type") == "gemma4_text":
            raise ValueError(
                "the planner does not model Gemma 4 (per-layer head dims, shared K/V layers, per-layer "
                "inputs) yet"
            )
        if get("kv_lora_rank") is not None:
            raise ValueError("the planner does not model latent attention (DeepSeek-V3's kv_lora_rank) yet")
        missing = [k for k in _REQUIRED if get(k) is None]
        if missing:
            raise ValueError(
                f"the config has no {', '.join(missing)} (a decoder's config.json needs "
                f"{', '.join(_REQUIRED)})"
            )
        try:
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            experts, width, intermediate, moe_extra = _moe(get) if family and family.moe else (0, 0, None, {})
            shape = cls(
                name=name or str(get("_name_or_path") or get("model_type") or "model"),
                hidden=hidden,
                intermediate=intermediate or int(get("intermediate_size")),
                layers=int(get("num_hidden_layers")),
                heads=heads,
                kv_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or hidden // heads),
                vocab=int(get("vocab_size")),
                tie_embeddings=bool(get("tie_word_embeddings", False)),
                attention_bias=bool(get("attention_bias", False)),
                mlp_bias=bool(get("mlp_bias", False)),
                qkv_bias=bool(family and family.qkv_bias),
                qk_norm=family.qk_norm if family else "",
                norms=family.norms if family else 2,
                fused=bool(family and family.fused),
                windows=tuple(layer_windows(config)),
                experts=experts,
                expert_intermediate=width,
                sinks=get("model_type") == "gpt_oss",
                **moe_extra,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"the config's sizes ({', '.join(_REQUIRED)}) must be integers: {exc}"
            ) from exc
        if shape.heads % shape.kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads")
        return shape

    # parameter counts ------------------------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection of one decoder layer, by module name
        (Phi-3's fused ``qkv_proj`` ``(h, q + 2*kv)`` and ``gate_up_proj`` ``(h, 2*i)``)."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        if self.fused:
            return {
                "qkv_proj": (h, q + 2 * kv),
                "o_proj": (q, h),
                "gate_up_proj": (h, 2 * i),
                "down_proj": (i, h),
            }
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def projections(self, group: str) -> tuple[str, ...]:
        """The module names of one input-sharing group: ``"qkv"`` (they read the first norm's
        output), ``"o"``, ``"gate_up"`` (the second norm's output) or ``"down"``."""
        if group == "qkv":
            return ("qkv_proj",) if self.fused else ("q_proj", "k_proj", "v_proj")
        if group == "gate_up":
            return ("gate_up_proj",) if self.fused else ("gate_proj", "up_proj")
        return {"o": ("o_proj",), "down": ("down_proj",)}[group]

    @property
    def qk_norm_params(self) -> int:
        """q/k RMSNorm weights of one layer: ``2*d`` per head (shared by the heads), or
        ``(nh + nkv)*d`` over all heads; 0 without q/k norms."""
        if self.qk_norm == "head":
            return 2 * self.head_dim
        if self.qk_norm == "all":
            return (self.heads + self.kv_heads) * self.head_dim
        return 0

    @property
    def layer_params(self) -> int:
        """One decoder layer (a sparse one, where some are dense): ``h*nh*d + 2*h*nkv*d + nh*d*h +
        3*h*i + norms*h`` (+ biases, + q/k norm weights; MoE: the experts, the router, a shared
        expert, gpt-oss's expert and router biases and sinks)."""
        return self.layer_params_at(-1)

    def layer_params_at(self, index: int) -> int:
        """The parameters of decoder layer ``index`` (-1: a sparse layer of a MoE model)."""
        shapes = self.linear_shapes()
        n = self.heads if self.sinks else 0
        if self.experts and index in self.dense_layers:  # Llama 4's dense layers
            i = self.dense_intermediate
            shapes.update(gate_proj=(self.hidden, i), up_proj=(self.hidden, i), down_proj=(i, self.hidden))
        elif self.experts:  # the experts' gate, up and down projections and the router
            shapes = {k: v for k, v in shapes.items() if k in ("q_proj", "k_proj", "v_proj", "o_proj")}
            shapes["experts"] = (self.experts * 3 * self.hidden, self.expert_intermediate)
            shapes["router"] = (self.hidden, self.experts)
            shapes["shared_expert"] = (3 * self.hidden, self.shared_expert_intermediate)
            if self.expert_bias:  # gate_up (2 * width) and down (h) per expert, the router's
                n += self.experts * (2 * self.expert_intermediate + self.hidden + 1)
        n += sum(a * b for a, b in shapes.values()) + self.norms * self.hidden
        if self.attention_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim + self.hidden
        elif self.qkv_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        return n + self.qk_norm_params

    @property
    def embedding_params(self) -> int:
        """Input embedding ``V*h``."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Output projection ``V*h`` (0 when tied to the input embedding)."""
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """``L * layer_params + V*h (embedding) + V*h (lm_head, unless tied) + h (final norm)``."""
        layers = sum(self.layer_params_at(i) for i in range(self.layers))
        return layers + self.embedding_params + self.lm_head_params + self.hidden

    def lora_params(self, rank: int, targets: Iterable[str] = DEFAULT_LORA_TARGETS) -> int:
        """``L * sum over targets of r * (in + out)`` (A is ``r x in``, B is ``out x r``)."""
        shapes = self.linear_shapes()
        if self.experts:  # the experts are not nn.Linear modules
            shapes = {k: v for k, v in shapes.items() if k in ("q_proj", "k_proj", "v_proj", "o_proj")}
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {', '.join(shapes)}")
        return self.layers * sum(rank * sum(shapes[t]) for t in targets)


def _moe(get) -> tuple[int, int, int, dict[str, Any]]:
    """``(experts, expert width, per-token width, other ModelShape fields)`` of a MoE config; a
    Qwen3-MoE config with dense layers (``mlp_only_layers``, ``decoder_sparse_step > 1``) is
    refused: not modelled. Llama 4: a shared expert of the expert width (counted in the per-token
    width), dense layers per ``moe_layers`` / ``interleave_moe_layer_step`` of width
    ``intermediate_size_mlp``; gpt-oss: biased experts and router."""
    if get("mlp_only_layers") or int(get("decoder_sparse_step") or 1) != 1:
        raise ValueError("the planner models MoE configs whose every layer is sparse (mlp_only_layers: [])")
    experts = int(get("num_experts") or get("num_local_experts"))
    width = int(get("moe_intermediate_size") or get("intermediate_size"))
    per_token = int(get("num_experts_per_tok") or get("experts_per_token")) * width
    extra: dict[str, Any] = {"expert_bias": get("model_type") == "gpt_oss"}
    if get("model_type") == "llama4_text":
        layers, step = int(get("num_hidden_layers")), int(get("interleave_moe_layer_step") or 1)
        moe = get("moe_layers")
        moe = list(range(step - 1, layers, step)) if moe is None else list(moe)  # Llama4TextConfig's rule
        extra.update(
            shared_expert_intermediate=width,
            dense_layers=tuple(i for i in range(layers) if i not in moe),
            dense_intermediate=int(get("intermediate_size_mlp") or 0),
        )
        per_token += width
    return experts, width, per_token, extra


def load_model_shape(model: Any) -> ModelShape:
    """A :class:`ModelShape` from a preset name, a config dict / ``PretrainedConfig``, a JSON file,
    a local model directory, or a hub name already in the local cache (never downloaded: a name
    that is neither a preset nor cached is refused at once, naming the presets and the fix).
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping) or hasattr(model, "hidden_size"):
        return ModelShape.from_config(model)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"cannot read a model shape from {type(model).__name__}")
    key = str(model).strip()
    preset = PRESET_ALIASES.get(key.lower(), key.lower())
    if preset in PRESETS:
        return ModelShape.from_config(PRESETS[preset], name=preset)
    if os.path.isfile(key):
        return _shape_from_json(key)
    if os.path.isdir(key) and not os.path.isfile(os.path.join(key, "config.json")):
        raise ValueError(f"model folder {key!r} has no config.json: pass the folder of a transformers model")
    if os.path.isdir(key):
        return _shape_from_json(os.path.join(key, "config.json"), name=key)
    close = difflib.get_close_matches(key.lower(), [*PRESETS, *PRESET_ALIASES], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    if os.path.isabs(key) or key.startswith(".") or key.count("/") != 1:
        raise ValueError(
            f"{key!r} is neither a preset nor an existing path: {hint}presets: {', '.join(PRESETS)}; or pass "
            "--config-json PATH or a local model folder"
        )
    # A hub name: the local cache only (no network: offline, the hub client retries for ~20 s).
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(key, local_files_only=True)
    except Exception:  # noqa: BLE001 - a missing cache entry comes as OSError, ValueError, ...
        raise ValueError(
            f"{key!r} is not a preset ({hint}presets: {', '.join(PRESETS)}) and its config is not in the "
            f"local cache: pass --config-json PATH (e.g. from `hf download {key} config.json`) or a local "
            "model folder"
        ) from None
    return ModelShape.from_config(config, name=key)


def _shape_from_json(path: str, name: str | None = None) -> ModelShape:
    """A shape from a config.json file; errors name the file."""
    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{path!r} is not a readable JSON file ({exc}): pass a transformers config.json"
        ) from None
    if not isinstance(config, Mapping):
        raise ValueError(f"{path!r} holds {type(config).__name__}, not a config mapping: pass a config.json")
    try:
        return ModelShape.from_config(config, name=name or os.path.basename(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
