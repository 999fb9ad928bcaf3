"""The model layer: ring attention inside transformers models.

Modules: ``patch`` (register the ring in transformers' ``AttentionInterface`` and switch a model to
it; the decoder pre-hook that checks each forward's inputs), ``unwrap`` (the decoder and output head
of a model, peft-wrapped or not), ``tiled_mlp`` / ``tiled_norm`` (the MLP / the RMSNorms over
checkpointed token tiles; ``token_tiles`` the shared wrapper), ``inference``
(:class:`RingInference`: sharded prefill, distributed KV cache, greedy decode).
"""

from ringft.model.patch import apply_ring_attention, remove_ring_attention, ring_attention, ring_spec

__all__ = ["apply_ring_attention", "remove_ring_attention", "ring_attention", "ring_spec"]
