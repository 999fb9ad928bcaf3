"""Pure math and communication for zigzag ring attention. Never imports transformers.

Modules: ``dtypes`` (dtype names, accumulator dtype), ``merge`` (log-sum-exp merge), ``backends``
(block backend interface and choice; backends in ``reference``, ``torch_backend``,
``flash_backend``), ``comm`` (ring exchange), ``zigzag_blocks`` + ``zigzag`` (the operator),
``validate`` (every rank fails together: one exchange of facts, then the checks), ``values``
(typed value checks with one error style, for every user-facing setting), ``decode`` (sharded KV
cache for inference), ``sharding`` (the zigzag layout: shard / unshard / global positions, the
sequence-length rule), ``documents`` (packed documents on the ring), ``emulate`` (the ring's
schedule in one process), ``parallel`` (the DP x CP process layout), ``spawn`` (N gloo processes
with a timeout).
"""

from ringft.ops.backends import BACKENDS, default_softmax_scale, get_backend
from ringft.ops.decode import ShardedKVCache, sharded_cache_attention
from ringft.ops.dtypes import DTYPES, accumulator_dtype, dtype_from_name, dtype_name
from ringft.ops.merge import merge_attention_
from ringft.ops.zigzag import zigzag_ring_attention

__all__ = [
    "BACKENDS",
    "DTYPES",
    "ShardedKVCache",
    "accumulator_dtype",
    "default_softmax_scale",
    "dtype_from_name",
    "dtype_name",
    "get_backend",
    "merge_attention_",
    "sharded_cache_attention",
    "zigzag_ring_attention",
]
