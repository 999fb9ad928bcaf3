"""Pure math and communication for zigzag ring attention. Never imports transformers."""

from ringft.ops.kernels import BACKENDS, get_backend
from ringft.ops.merge import merge_attention_
from ringft.ops.zigzag import zigzag_ring_attention

__all__ = ["BACKENDS", "get_backend", "merge_attention_", "zigzag_ring_attention"]
