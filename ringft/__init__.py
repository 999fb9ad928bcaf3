"""ringft: fine-tune Hugging Face decoders (LLaMA, Mistral, Qwen2/2.5, Qwen3, Gemma 3, Phi-3, OLMo 2/3,
SmolLM3, Ministral 3, Mixtral, Qwen3-MoE) at very long context with exact zigzag ring attention
(sliding windows included).

The names below are the public API. The attention operator, sharding, the collator and the model
patch import eagerly (torch + transformers only); the inference engine, the loss helpers and the
trainer load on first use (``ringft train``'s Python entry is ``ringft.train.train``: ``ringft.train``
is its package; ``RingTrainerMixin`` puts the ring into ``transformers.Trainer`` / TRL's
``SFTTrainer``, ``RingDPOTrainer`` / ``RingGRPOTrainer`` TRL's ``DPOTrainer`` / ``GRPOTrainer``: TRL
is imported only then), so ``import ringft`` does not pull in accelerate, peft or datasets.
"""

from __future__ import annotations

import importlib
from typing import Any

from ringft.data.collator import RingDataCollator, pad_and_shard
from ringft.model.patch import apply_ring_attention, remove_ring_attention, ring_attention, ring_spec
from ringft.ops import build_layout, ulysses_ring_attention, zigzag_ring_attention
from ringft.ops.sharding import cp_gather, cp_position_ids, cp_shard, cp_unshard

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    "RingInference": "ringft.model.inference",
    "CausalLMLoss": "ringft.loss",
    "chunked_lm_loss": "ringft.loss",
    "loss_normalization": "ringft.loss",
    "Recipe": "ringft.train",
    "RingDPOTrainer": "ringft.train.hf.dpo",
    "RingGRPOTrainer": "ringft.train.hf.grpo",
    "RingTrainerMixin": "ringft.train.hf",
    "TrainError": "ringft.train",
    "load_recipe": "ringft.train",
}

__all__ = [
    "CausalLMLoss",
    "Recipe",
    "RingDataCollator",
    "RingDPOTrainer",
    "RingGRPOTrainer",
    "RingInference",
    "RingTrainerMixin",
    "TrainError",
    "apply_ring_attention",
    "build_layout",
    "chunked_lm_loss",
    "cp_gather",
    "cp_position_ids",
    "cp_shard",
    "cp_unshard",
    "load_recipe",
    "loss_normalization",
    "pad_and_shard",
    "remove_ring_attention",
    "ring_attention",
    "ring_spec",
    "ulysses_ring_attention",
    "zigzag_ring_attention",
]


def __getattr__(name: str) -> Any:
    """Load the lazily exported names (``ringft.train``, ``ringft.RingInference``, ...)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ringft' has no attribute {name!r}")
