"""Model shapes for the planner: the sizes of a decoder that memory depends on.

``h`` hidden size, ``i`` MLP intermediate size, ``L`` layers, ``nh`` attention heads, ``nkv``
key/value heads, ``d`` head dim (Gemma 3, Qwen3: not ``h / nh``), ``V`` vocabulary, and the family
facts of :data:`ringft.model.families.FAMILIES` (q/k norms, q/k/v bias, norms per layer, fused
projections). Read from presets (:data:`PRESETS`, no download), a config dict or
``PretrainedConfig`` (a multimodal config's ``text_config``), a config.json, or a model directory.
Layers that differ (latent attention, Gemma 4's local / global / K/V-reusing layers, Gated DeltaNet
layers, dense layers of a MoE model) are read as one view per layer (:meth:`ModelShape.layer`).
Sliding windows are recorded (``windows``) but change no memory term: a window lowers the attention
FLOPs, while every rank still keeps the K/V of all its local tokens for the backward.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ringft.model.families import FAMILIES, layer_windows
from ringft.planner.presets import PRESET_ALIASES, PRESETS
from ringft.planner.shape_families import family_fields, mixer_params, mixer_shapes, moe_fields

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
    shared_expert_gate: bool = False  # Qwen3.5-MoE / Qwen3-Next: a sigmoid gate (h x 1) on the shared expert
    model_type: str = ""
    # latent attention (DeepSeek-V3, Mistral 4): ``head_dim`` = q/k's nope + rope, V and the output
    # at ``v_head_dim``, K/V at every query head; q/kv down-projections to these ranks (0: no q_a)
    v_head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    attn_gate: bool = False  # Qwen3.5 / Qwen3-Next full attention: q_proj also makes an output gate
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): their indices and (k heads, v heads, k dim, v dim,
    # conv kernel)
    linear_layers: tuple[int, ...] = ()
    linear_dims: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    # Gemma 4: the global layers' head dim and K/V heads, the last layers reusing an earlier layer's
    # K/V, V from the K projection on global layers, double-wide MLP on the reusing layers, per-layer
    # inputs of this width over ``per_layer_vocab`` tokens, a weightless RMSNorm on V
    global_layers: tuple[int, ...] = ()
    global_head_dim: int = 0
    global_kv_heads: int = 0
    kv_shared_layers: int = 0
    k_eq_v: bool = False
    double_wide_mlp: bool = False
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    v_norm: bool = False
    # one layer's view (:meth:`layer`): its token mixer ("attention" / "linear"), K/V reused from an
    # earlier layer, V = K
    mixer: str = "attention"
    kv_shared: bool = False
    v_from_k: bool = False

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a transformers ``PretrainedConfig`` or a config dict (transformers key names); a
        multimodal config (Gemma 3 4B+) gives its ``text_config``."""
        if not isinstance(config, Mapping) and getattr(config, "model_type", None) == "gemma4_text":
            config = config.to_dict()  # its per-layer sizes refuse a global read
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
        moe = bool(family and family.moe)
        missing = [k for k in _REQUIRED if get(k) is None and not (moe and k == "intermediate_size")]
        if missing:
            raise ValueError(
                f"the config has no {', '.join(missing)} (a decoder's config.json needs "
                f"{', '.join(_REQUIRED)})"
            )
        try:
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            experts, width, intermediate, moe_extra = moe_fields(get) if moe else (0, 0, None, {})
            fields = {
                "kv_heads": int(get("num_key_value_heads") or heads),
                "head_dim": int(get("head_dim") or hidden // heads),
                **family_fields(get, family),
            }
            shape = cls(
                name=name or str(get("_name_or_path") or get("model_type") or "model"),
                hidden=hidden,
                intermediate=intermediate or int(get("intermediate_size")),
                layers=int(get("num_hidden_layers")),
                heads=heads,
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
                model_type=str(get("model_type") or ""),
                **moe_extra,
                **fields,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the config's sizes ({', '.join(_REQUIRED)}) must be integers: {exc}") from exc
        if shape.heads % shape.kv_heads or (shape.global_kv_heads and shape.heads % shape.global_kv_heads):
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads")
        return shape

    # one layer ----------------------------------------------------------------------------------
    @property
    def v_dim(self) -> int:
        """V's and the attention output's head dim (latent attention: ``v_head_dim``; else ``d``)."""
        return self.v_head_dim or self.head_dim

    def layer(self, index: int) -> ModelShape:
        """Layer ``index`` as a uniform shape (a *view*): its token mixer (a Gated DeltaNet layer's
        ``mixer="linear"``), Gemma 4's global head dim / K/V heads, K/V reused from an earlier layer
        (``kv_shared``) and ``V = K`` (``v_from_k``), a dense MLP in a MoE model."""
        if not 0 <= index < self.layers:
            raise IndexError(f"layer {index} of a {self.layers}-layer model")
        view: dict[str, Any] = {"linear_layers": (), "dense_layers": (), "global_layers": ()}
        view.update(global_head_dim=0, kv_shared_layers=0)
        if index in self.linear_layers:
            view["mixer"] = "linear"
        if self.global_head_dim:  # Gemma 4
            is_global = index in self.global_layers
            shared = index >= self.layers - self.kv_shared_layers
            view.update(kv_shared=shared, v_from_k=self.k_eq_v and is_global and not shared)
            if is_global:
                view.update(head_dim=self.global_head_dim, kv_heads=self.global_kv_heads or self.kv_heads)
            if shared and self.double_wide_mlp:
                view["intermediate"] = 2 * self.intermediate
        if self.experts and index in self.dense_layers:  # a dense layer of a MoE model
            view.update(experts=0, intermediate=self.dense_intermediate, expert_intermediate=0)
            view.update(shared_expert_intermediate=0, shared_expert_gate=False, expert_bias=False)
        return replace(self, **view)

    def layer_views(self) -> dict[ModelShape, int]:
        """Each distinct layer view (:meth:`layer`) and how many layers have it."""
        views: dict[ModelShape, int] = {}
        for i in range(self.layers):
            view = self.layer(i)
            views[view] = views.get(view, 0) + 1
        return views

    # parameter counts ------------------------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection of one decoder layer (view), by module
        name: the token mixer's (:func:`~ringft.planner.shape_families.mixer_shapes`), the MLP's
        (Phi-3's fused ``gate_up_proj`` ``(h, 2*i)``), Gemma 4's per-layer input gate and projection."""
        h, i = self.hidden, self.intermediate
        shapes = mixer_shapes(self)
        if self.fused:
            shapes.update(gate_up_proj=(h, 2 * i), down_proj=(i, h))
        else:
            shapes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
        if self.per_layer_input:
            shapes.update(per_layer_input_gate=(h, self.per_layer_input))
            shapes.update(per_layer_projection=(self.per_layer_input, h))
        return shapes

    def projections(self, group: str) -> tuple[str, ...]:
        """The module names of one input-sharing group: ``"qkv"`` (they read the first norm's
        output), ``"o"``, ``"gate_up"`` (the second norm's output) or ``"down"``."""
        if group == "qkv":
            skip = ("o_proj", "out_proj", "q_b_proj", "kv_b_proj")
            return tuple(n for n in mixer_shapes(self) if n not in skip)
        if group == "gate_up":
            return ("gate_up_proj",) if self.fused else ("gate_proj", "up_proj")
        if group == "o":
            return ("out_proj",) if self.mixer == "linear" else ("o_proj",)
        return {"down": ("down_proj",)}[group]

    @property
    def qk_norm_params(self) -> int:
        """q/k RMSNorm weights of one layer: ``2*d`` per head (shared by the heads; ``d`` on a layer
        reusing K/V), or ``(nh + nkv)*d`` over all heads; 0 without q/k norms."""
        if self.qk_norm == "head":
            return (1 if self.kv_shared else 2) * self.head_dim
        if self.qk_norm == "all":
            return (self.heads + self.kv_heads) * self.head_dim
        return 0

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (a ZeRO-3 gather unit): ``h*nh*d + 2*h*nkv*d + nh*d*h +
        3*h*i + norms*h`` for a LLaMA-style layer (+ biases, + q/k norm weights; MoE: the experts,
        the router, a shared expert, gpt-oss's expert and router biases and sinks)."""
        return max(self.layer_params_at(i) for i in range(self.layers))

    def layer_params_at(self, index: int) -> int:
        """The parameters of decoder layer ``index``."""
        return self.layer(index).own_params(active=False)

    def own_params(self, active: bool = False) -> int:
        """This layer view's parameters; ``active``: the experts one token runs (the matmul weights
        of the time model) instead of all of them."""
        shapes = self.linear_shapes()
        n = mixer_params(self) + self.norms * self.hidden
        if self.per_layer_input:  # Gemma 4's post-per-layer-input norm
            n += self.hidden
        if self.experts:  # the experts' gate, up and down projections and the router
            shapes = {k: v for k, v in shapes.items() if k not in ("gate_proj", "up_proj", "down_proj")}
            count = (self.intermediate - self.shared_expert_intermediate) // self.expert_intermediate
            experts = count if active else self.experts
            shapes["experts"] = (experts * 3 * self.hidden, self.expert_intermediate)
            shapes["router"] = (self.hidden, self.experts)
            shapes["shared_expert"] = (3 * self.hidden, self.shared_expert_intermediate)
            shapes["shared_expert_gate"] = (self.hidden, 1 if self.shared_expert_gate else 0)
            if self.expert_bias:  # gate_up (2 * width) and down (h) per expert, the router's
                n += self.experts * (2 * self.expert_intermediate + self.hidden + 1)
        elif self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        return n + sum(a * b for a, b in shapes.values())

    @property
    def embedding_params(self) -> int:
        """Input embedding ``V*h``."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Output projection ``V*h`` (0 when tied to the input embedding)."""
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    @property
    def per_layer_input_params(self) -> int:
        """Gemma 4's per-layer inputs: their embedding ``V' x L*p``, projection ``h x L*p`` and norm ``p``."""
        p = self.per_layer_input
        return p * (self.layers * (self.per_layer_vocab + self.hidden) + 1) if p else 0

    @property
    def total_params(self) -> int:
        """``sum of the layers + V*h (embedding) + V*h (lm_head, unless tied) + h (final norm)``
        (+ Gemma 4's per-layer input embedding and projection)."""
        layers = sum(self.layer_params_at(i) for i in range(self.layers))
        extra = self.per_layer_input_params
        return layers + self.embedding_params + self.lm_head_params + self.hidden + extra

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """q/k/v/o (:data:`DEFAULT_LORA_TARGETS`) where the model has them all; else the family's
        attention projections (latent attention's ``q_a_proj``, ``kv_b_proj``, ...)."""
        names = {n for i in range(self.layers) for n in self.layer(i).linear_shapes()}
        if set(DEFAULT_LORA_TARGETS) <= names:
            return DEFAULT_LORA_TARGETS
        family = FAMILIES.get(self.model_type)
        own = family.attention_projections if family else DEFAULT_LORA_TARGETS
        return tuple(n for n in own if n in names)

    def lora_params(self, rank: int, targets: Iterable[str] = DEFAULT_LORA_TARGETS) -> int:
        """``sum over layers and targets of r * (in + out)`` (A is ``r x in``, B is ``out x r``); a
        target adapts the layers that have it (as peft matches names), and must exist in one."""
        targets = tuple(targets)
        per_layer = [self.layer(i).linear_shapes() for i in range(self.layers)]
        if self.experts:  # the experts are not nn.Linear modules
            mlp = ("gate_proj", "up_proj", "down_proj")
            per_layer = [{k: v for k, v in s.items() if k not in mlp} for s in per_layer]
        known = list(dict.fromkeys(n for s in per_layer for n in s))
        unknown = [t for t in targets if t not in known]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {', '.join(known)}")
        return sum(rank * sum(s[t]) for s in per_layer for t in targets if t in s)


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
