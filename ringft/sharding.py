"""Zigzag index math: shard / unshard tensors along the sequence, global position ids.

The global sequence (length ``S``) is cut into ``2N`` equal chunks; rank ``r`` of an ``N``-rank
context-parallel group holds chunks ``r`` and ``2N-1-r``, concatenated. Pairing an early chunk with
a late one gives every rank the same amount of causal attention work.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _check(seq_len: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if seq_len % (2 * world_size) != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp_size = {2 * world_size}: pad it "
            f"to a multiple of {2 * world_size} (RingDataCollator pads automatically)"
        )


def zigzag_chunk_ids(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunk indices (out of ``2 * world_size``) held by ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    return rank, 2 * world_size - 1 - rank


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """This rank's zigzag shard of ``x`` along ``dim`` (default 1: ``(batch, seq, ...)``)."""
    _check(x.shape[dim], world_size)
    chunks = x.chunk(2 * world_size, dim=dim)
    first, second = zigzag_chunk_ids(rank, world_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(shards: list[Tensor] | tuple[Tensor, ...], dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_shard`: the global tensor from the per-rank shards in rank order."""
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("zigzag_unshard needs at least one shard")
    chunks: list[Tensor | None] = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % 2 != 0:
            raise ValueError(f"shard of rank {rank} has odd length {shard.shape[dim]} along dim {dim}")
        first, second = zigzag_chunk_ids(rank, world_size)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def zigzag_position_ids(seq_len: int, rank: int, world_size: int, device=None) -> Tensor:
    """Global positions ``(seq_len // world_size,)`` (int64) of the tokens held by ``rank``."""
    return zigzag_shard(torch.arange(seq_len, device=device), rank, world_size, dim=0)


def zigzag_gather(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """All-gather zigzag shards (e.g. logits or hidden states) across ``group`` into global order.

    Every rank passes its own shard (same shape on all ranks) and gets the full tensor back.
    Not differentiable (inference helper).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x, group=group)
    return zigzag_unshard(pieces, dim=dim)
