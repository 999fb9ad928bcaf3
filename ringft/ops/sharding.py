"""Zigzag index math: shard / unshard tensors along the sequence, global position ids.

The global sequence (length ``S``) is cut into ``2N`` equal chunks; rank ``r`` of an ``N``-rank
context-parallel group holds chunks ``r`` and ``2N-1-r``, concatenated. Pairing an early chunk with
a late one gives every rank the same amount of causal attention work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _check(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp_size = {2 * cp_size}: pad it "
            f"to a multiple of {2 * cp_size} (RingDataCollator pads automatically)"
        )


def zigzag_chunk_ids(rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (out of ``2 * cp_size``) held by ``rank``."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} is outside 0..{cp_size - 1}")
    return rank, 2 * cp_size - 1 - rank


def zigzag_shard(x: Tensor, rank: int, cp_size: int, dim: int = 1) -> Tensor:
    """This rank's zigzag shard of ``x`` along ``dim`` (default 1): ``(batch, seq, ...)`` ->
    ``(batch, seq // cp_size, ...)``, chunks ``rank`` and ``2 * cp_size - 1 - rank`` of ``2 * cp_size``."""
    _check(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = zigzag_chunk_ids(rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(shards: list[Tensor] | tuple[Tensor, ...], dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_shard`: ``cp_size`` shards ``(batch, seq // cp_size, ...)`` in rank
    order -> the global ``(batch, seq, ...)`` (along ``dim``)."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("zigzag_unshard needs at least one shard")
    chunks: list[Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % 2 != 0:
            raise ValueError(f"shard of rank {rank} has odd length {shard.shape[dim]} along dim {dim}")
        first, second = zigzag_chunk_ids(rank, cp_size)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def zigzag_position_ids(seq_len: int, rank: int, cp_size: int, device=None) -> Tensor:
    """Global positions ``(seq_len // cp_size,)`` (int64) of the tokens held by ``rank``."""
    return zigzag_shard(torch.arange(seq_len, device=device), rank, cp_size, dim=0)


def zigzag_gather(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """All-gather zigzag shards (e.g. logits ``(batch, seq_local, vocab)``) across ``group`` into
    global order ``(batch, seq, vocab)``.

    Every rank passes its own shard (same shape on all ranks) and gets the full tensor back.
    Not differentiable (inference helper).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x, group=group)
    return zigzag_unshard(pieces, dim=dim)
