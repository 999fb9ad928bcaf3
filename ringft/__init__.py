"""ringft: fine-tune Hugging Face LLaMA / Mistral models at very long context with zigzag ring attention."""

from ringft.data.collator import RingDataCollator
from ringft.hf import apply_ring_attention, remove_ring_attention, ring_attention
from ringft.ops import zigzag_ring_attention
from ringft.sharding import zigzag_gather, zigzag_position_ids, zigzag_shard, zigzag_unshard

__version__ = "0.1.0"

__all__ = [
    "RingDataCollator",
    "apply_ring_attention",
    "remove_ring_attention",
    "ring_attention",
    "zigzag_gather",
    "zigzag_position_ids",
    "zigzag_ring_attention",
    "zigzag_shard",
    "zigzag_unshard",
]
