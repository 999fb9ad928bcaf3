"""Model shapes for the planner: the sizes of a LLaMA/Mistral-style decoder that memory depends on.

``h`` hidden size, ``i`` MLP intermediate size, ``L`` layers, ``nh`` attention heads, ``nkv``
key/value heads, ``d`` head dim, ``V`` vocabulary. Read from presets (:data:`PRESETS`, no
download), a config dict or ``PretrainedConfig``, a config.json, or a model directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_LORA_TARGETS", "PRESETS", "ModelShape", "load_model_shape"]

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

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
}
_PRESET_ALIASES = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/llama-3.1-8b": "llama-3-8b",
    "llama-3.1-8b": "llama-3-8b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistral-7b-v0.3": "mistral-7b",
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a LLaMA/Mistral-style decoder that memory depends on."""

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

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a transformers ``PretrainedConfig`` or a config dict (transformers key names)."""
        get = (
            config.get if isinstance(config, Mapping) else lambda k, default=None: getattr(config, k, default)
        )
        try:
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            shape = cls(
                name=name or str(get("_name_or_path") or get("model_type") or "model"),
                hidden=hidden,
                intermediate=int(get("intermediate_size")),
                layers=int(get("num_hidden_layers")),
                heads=heads,
                kv_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or hidden // heads),
                vocab=int(get("vocab_size")),
                tie_embeddings=bool(get("tie_word_embeddings", False)),
                attention_bias=bool(get("attention_bias", False)),
                mlp_bias=bool(get("mlp_bias", False)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                "the config needs hidden_size, intermediate_size, num_hidden_layers, "
                f"num_attention_heads and vocab_size (a LLaMA/Mistral-style config): {exc}"
            ) from exc
        if shape.heads % shape.kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads")
        return shape

    # parameter counts ------------------------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection of one decoder layer."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        """One decoder layer: ``h*nh*d + 2*h*nkv*d + nh*d*h + 3*h*i + 2*h`` (+ biases)."""
        n = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.attention_bias:
            n += (self.heads + 2 * self.kv_heads) * self.head_dim + self.hidden
        if self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        return n

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
        return self.layers * self.layer_params + self.embedding_params + self.lm_head_params + self.hidden

    def lora_params(self, rank: int, targets: Iterable[str] = DEFAULT_LORA_TARGETS) -> int:
        """``L * sum over targets of r * (in + out)`` (A is ``r x in``, B is ``out x r``)."""
        shapes = self.linear_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {', '.join(shapes)}")
        return self.layers * sum(rank * sum(shapes[t]) for t in targets)


def load_model_shape(model: Any) -> ModelShape:
    """A :class:`ModelShape` from a preset name, a config dict / ``PretrainedConfig``, a JSON file,
    or a local directory / hub name (``AutoConfig.from_pretrained``, which needs the hub or cache).
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping) or hasattr(model, "hidden_size"):
        return ModelShape.from_config(model)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"cannot read a model shape from {type(model).__name__}")
    key = str(model).strip()
    preset = _PRESET_ALIASES.get(key.lower(), key.lower())
    if preset in PRESETS:
        return ModelShape.from_config(PRESETS[preset], name=preset)
    if os.path.isfile(key):
        with open(key) as fh:
            return ModelShape.from_config(json.load(fh), name=os.path.basename(key))
    if not os.path.exists(key) and (os.path.isabs(key) or key.startswith(".") or key.count("/") > 1):
        raise ValueError(f"{key!r} does not exist; use a preset ({', '.join(PRESETS)}) or a config.json path")
    try:
        from transformers import AutoConfig

        try:  # the local cache first: no network round trips when it is there
            config = AutoConfig.from_pretrained(key, local_files_only=True)
        except OSError:
            config = AutoConfig.from_pretrained(key)
        return ModelShape.from_config(config, name=key)
    except Exception as exc:  # noqa: BLE001 - hub/cache errors come in many types
        raise ValueError(
            f"could not load a config for {key!r} ({type(exc).__name__}: {exc}). Use a preset "
            f"({', '.join(PRESETS)}), a config.json path or a local model directory"
        ) from exc
