"""Exact attention of new tokens against a KV cache that is split across a CP group.

Each rank holds the K/V of its own shard of the prompt (any subset of positions; order does not
matter without a mask, since every cached key precedes the new query). Every rank computes the
partial attention of the (replicated) new queries against its part, the partial results are
all-gathered and merged by log-sum-exp, so every rank ends with the same, exact output.

:class:`ShardedKVCache` is that cache: per layer, this rank's keys/values in increasing global
position, filled by one ring prefill, grown one token at a time by decode steps (on CP rank 0),
and truncatable back to any earlier length (e.g. the prompt, after teacher-forcing an answer).
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from ringft.ops.backends import default_softmax_scale, get_backend
from ringft.ops.comm import group_rank_and_size
from ringft.ops.dtypes import accumulator_dtype, follow_autocast, no_autocast
from ringft.ops.merge import merge_attention_

Tensor = torch.Tensor

__all__ = ["ShardedKVCache", "sharded_cache_attention"]


def sharded_cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
) -> Tensor:
    """q ``(batch, new, heads_q, dim)`` against every rank's ``k/v_cache`` ``(batch, cached, heads_kv, dim)``.

    The new queries see every cached key (the cache holds only earlier positions); causality among
    the ``new`` tokens themselves is the caller's job (decode one token at a time). Returns
    ``(batch, new, heads_q, dim)`` in q's dtype, identical on every rank. A rank may hold an empty
    cache (``cached == 0``), as long as one rank does not.
    """
    q, k_cache, v_cache = follow_autocast(q, k_cache, v_cache)  # like scaled_dot_product_attention
    with no_autocast(q.device.type):
        return _merged_cache_attention(q, k_cache, v_cache, softmax_scale, group, backend)


def _merged_cache_attention(q, k_cache, v_cache, softmax_scale, group, backend) -> Tensor:
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    acc = accumulator_dtype(q.dtype)
    b, n, h, _ = q.shape
    if k_cache.shape[1] > 0:
        out, lse = get_backend(backend, q.device, q.dtype, q.shape[-1]).forward(
            q, k_cache, v_cache, False, scale
        )
        out, lse = out.to(acc), lse.to(acc)
    else:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    _, size = group_rank_and_size(group)
    if size == 1:
        return out.to(q.dtype)
    packed = torch.cat([out.reshape(-1), lse.reshape(-1)]).contiguous()
    parts = [torch.empty_like(packed) for _ in range(size)]
    dist.all_gather(parts, packed, group=group)
    split = out.numel()
    outs = [p[:split].view(out.shape) for p in parts]
    lses = [p[split:].view(lse.shape) for p in parts]
    # Start from a rank whose cache is not empty (its lse is finite), then merge the others in
    # rank order so that every rank performs the identical sequence of operations.
    first = next(i for i, x in enumerate(lses) if torch.isfinite(x).all())
    total_out, total_lse = outs[first].clone(), lses[first].clone()
    for i in range(size):
        if i != first:
            merge_attention_(total_out, total_lse, outs[i], lses[i])
    return total_out.to(q.dtype)


class ShardedKVCache:
    """This rank's share of one batch of sequences' keys/values, for decoding on a CP group.

    Per attention layer: keys and values ``(batch, cached, heads_kv, head_dim)`` of the global
    positions :attr:`positions` (host ints, increasing) that this rank holds. Built for a prompt of
    ``length`` tokens whose local tokens sit at ``local_positions`` (the zigzag positions of this
    rank, pads included): :meth:`store_prefill` keeps the local tokens that are not pads;
    :meth:`decode_attention` attends one new token (replicated on every rank) to the whole
    sharded cache, and CP rank 0 (``owner``) keeps its K/V; :meth:`advance` then counts it.
    :meth:`truncate` drops every position ``>= length``. Every rank must make the same calls.
    """

    def __init__(self, local_positions: list[int], length: int, *, owner: bool):
        if any(b <= a for a, b in zip(local_positions, local_positions[1:])):
            raise ValueError("ShardedKVCache: local positions must be increasing (zigzag order)")
        self.positions = [p for p in local_positions if p < length]  # a prefix: pads come last
        self.length = length  # tokens in the (global) sequence so far
        self.owner = owner
        self._layers: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def is_prefilled(self) -> bool:
        """Whether the prompt has been run (attention calls are now decode steps)."""
        return bool(self._layers)

    def is_filled(self, layer: int) -> bool:
        """Whether ``layer`` has been prefilled (then its attention calls are decode steps)."""
        return layer in self._layers

    def store_prefill(self, layer: int, key: Tensor, value: Tensor) -> None:
        """Keep this rank's prompt K/V of ``layer``: ``key``/``value`` ``(batch, seq_local,
        heads_kv, head_dim)`` in local (zigzag) order, pads at the end of the kept prefix dropped."""
        keep = len(self.positions)
        key, value = follow_autocast(key, value)
        self._layers[layer] = (key[:, :keep].contiguous(), value[:, :keep].contiguous())

    def decode_attention(
        self,
        layer: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        softmax_scale: float | None,
        group: dist.ProcessGroup | None,
        backend: str,
        sliding_window: int | None = None,
    ) -> Tensor:
        """Attention of the token at position :attr:`length` over every cached position and itself.

        ``query`` ``(batch, 1, heads_q, head_dim)``, ``key``/``value`` ``(batch, 1, heads_kv,
        head_dim)``, identical on every rank. With ``sliding_window`` ``W`` only the keys at
        positions ``> length - W`` are seen (transformers' sliding-window mask; each layer passes
        its own, so per-layer windows such as Gemma 3's local/global layers decode exactly; the
        prefill honours the same window in the ring). Returns ``(batch, 1, heads_q, head_dim)``,
        identical on every rank.
        """
        if query.shape[1] != 1:
            raise ValueError(f"decode takes one new token at a time, got {query.shape[1]}")
        k_cache, v_cache = self._layers[layer]
        query, key, value = follow_autocast(query, key, value)
        positions = self.positions
        if self.owner:  # the generated tokens live on CP rank 0 (counted once)
            k_cache = torch.cat([k_cache, key], dim=1)
            v_cache = torch.cat([v_cache, value], dim=1)
            self._layers[layer] = (k_cache, v_cache)
            positions = [*positions, self.length]
        start = 0
        if sliding_window is not None:
            # Positions are increasing, so the visible keys are a suffix: no mask, no host sync.
            start = bisect.bisect_right(positions, self.length - sliding_window)
        return sharded_cache_attention(
            query,
            k_cache[:, start:],
            v_cache[:, start:],
            softmax_scale=softmax_scale,
            group=group,
            backend=backend,
        )

    def advance(self) -> None:
        """Count the token that the last decode step appended (call once per decode forward)."""
        if self.owner:
            self.positions.append(self.length)
        self.length += 1

    def truncate(self, length: int) -> None:
        """Forget every position ``>= length`` (e.g. back to the prompt after teacher forcing)."""
        if not 0 < length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        keep = bisect.bisect_left(self.positions, length)
        self.positions = self.positions[:keep]
        self._layers = {i: (k[:, :keep], v[:, :keep]) for i, (k, v) in self._layers.items()}
        self.length = length
