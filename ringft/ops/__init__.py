"""Pure math and communication for zigzag ring attention. Never imports transformers, nor the option
checks of ``ringft.utils``.

Modules: ``dtypes`` (dtype names, accumulator dtype), ``merge`` (log-sum-exp merge), ``backends``
(block backend interface, choice and the list of names; backends in ``reference``,
``torch_backend``, ``flash_backend``, ``cudnn_backend``), ``comm`` (the point-to-point exchange),
``ring_loop`` (the one forward / backward loop over a schedule), ``zigzag_blocks`` (the full ring's
schedule) + ``zigzag`` (the operator), ``ring_checks`` (its input checks), ``validate``
(every rank fails together: one exchange of facts, then the checks), ``decode`` (sharded KV cache
for inference), ``sharding`` (which tokens a CP rank holds: shard / unshard / global positions, the
sequence-length rule, for the ring and for Ulysses x ring), ``documents`` (packed documents on the
ring), sliding windows (``windows``: which chunks meet and the exchange schedule; ``window_blocks``:
its steps; ``band``, ``flash_window``: band attention between two blocks), ``emulate`` (the
ring's schedule in one process), ``parallel`` (the DP x CP process layout, CP = Ulysses x ring,
over one device mesh);
2D context parallelism (Ulysses x ring): ``alltoall`` (sequence <-> head shards), ``ulysses`` (the
operator).
"""

from ringft.ops.backends import BACKENDS, default_softmax_scale, get_backend
from ringft.ops.decode import ShardedKVCache, sharded_cache_attention
from ringft.ops.dtypes import DTYPES, accumulator_dtype, dtype_from_name, dtype_name
from ringft.ops.merge import merge_attention_
from ringft.ops.parallel import ParallelLayout, build_layout
from ringft.ops.ulysses import ulysses_ring_attention
from ringft.ops.zigzag import zigzag_ring_attention

__all__ = [
    "BACKENDS",
    "DTYPES",
    "ParallelLayout",
    "ShardedKVCache",
    "accumulator_dtype",
    "build_layout",
    "default_softmax_scale",
    "dtype_from_name",
    "dtype_name",
    "get_backend",
    "merge_attention_",
    "sharded_cache_attention",
    "ulysses_ring_attention",
    "zigzag_ring_attention",
]
