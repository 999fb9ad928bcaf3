"""Zigzag index math: shard / unshard tensors along the sequence, global position ids.

The global sequence (length ``S``) is cut into ``2N`` equal chunks; rank ``r`` of an ``N``-rank
context-parallel group holds chunks ``r`` and ``2N-1-r``, concatenated. Pairing an early chunk with
a late one gives every rank the same amount of causal attention work.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def zigzag_length_problem(
    seq_len: int, cp_size: int, subject: str | None = None, fix: str | None = None
) -> str | None:
    """The one rule of the zigzag layout: a global sequence of ``seq_len`` tokens is cut into
    ``2 * cp_size`` equal chunks, two per rank (so ``seq_local = seq_len / cp_size`` is even).

    None when ``seq_len`` obeys it; else one line naming ``subject`` (default ``"sequence length
    <seq_len>"``) and ``fix`` (default: the next multiple).
    """
    unit = zigzag_padded_length(1, cp_size)
    if seq_len % unit == 0:
        return None
    subject = subject or f"sequence length {seq_len}"
    fix = fix or f"use a multiple of {unit}, e.g. {zigzag_padded_length(seq_len, cp_size)}"
    return (
        f"{subject} is not divisible by 2 * cp_size = {unit} (each rank holds two equal zigzag chunks, "
        f"so seq_local = S / cp_size must be even): {fix}"
    )


def zigzag_padded_length(length: int, cp_size: int, multiple_of: int | None = None) -> int:
    """The shortest global length ``>= length`` (at least one chunk pair per rank) that obeys
    :func:`zigzag_length_problem` and is a multiple of ``multiple_of`` (if given)."""
    unit = 2 * cp_size
    if multiple_of:
        unit = math.lcm(unit, multiple_of)
    return max(unit, -(-length // unit) * unit)


def local_length_problem(seq_local: int, cp_size: int) -> str | None:
    """:func:`zigzag_length_problem` seen from one rank holding ``seq_local`` tokens of each row."""
    return zigzag_length_problem(
        seq_local * cp_size,
        cp_size,
        subject=f"the global sequence (seq_local {seq_local} x cp_size {cp_size})",
        fix="pad the global sequence to a multiple of 2 * cp_size (RingDataCollator does this)",
    )


def _check(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    problem = zigzag_length_problem(
        seq_len, cp_size, fix="pad it to a multiple of 2 * cp_size (RingDataCollator pads automatically)"
    )
    if problem:
        raise ValueError(problem)


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
        problem = zigzag_length_problem(
            shard.shape[dim] * cp_size, cp_size, subject=f"shard of rank {rank} (length {shard.shape[dim]})"
        )
        if problem:
            raise ValueError(problem)
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
