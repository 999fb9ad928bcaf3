"""Which tokens each CP rank holds: shard / unshard along the sequence, global positions, the
sequence-length rule.

The CP group of ``cp_size = ulysses_size x ring_size`` ranks: CP rank ``c`` is ``(ring rank p,
Ulysses rank u)`` with ``c = p * ulysses_size + u`` (a Ulysses group is ``ulysses_size`` contiguous
CP ranks, a ring group the CP ranks of equal Ulysses rank). For a global sequence of ``S`` tokens,
``R = ring_size``, ``U = ulysses_size``:

- the sequence is zigzag-sharded over the *ring*: cut into ``2R`` equal chunks, ring rank ``p`` owns
  chunks ``p`` and ``2R-1-p`` concatenated (its *ring shard*, ``S / R`` tokens). Pairing an early
  chunk with a late one gives every rank the same amount of causal attention work;
- that ring shard is cut into ``U`` contiguous equal pieces; CP rank ``(p, u)`` holds piece ``u``
  (``S / cp_size`` tokens, in increasing global order).

With ``ulysses_size = 1`` (the default everywhere) this is the zigzag layout of the ring alone: rank
``r`` of ``N`` holds chunks ``r`` and ``2N-1-r`` of ``2N``. With ``ring_size = 1`` it is plain
contiguous sharding (pure Ulysses). Inside attention, an all-to-all over the Ulysses group gives each
rank its ``1/U`` of the heads over the whole ring shard (pieces ``0..U-1`` in order), which is what
zigzag ring attention of ``R`` ranks expects.

Divisibility: ``S`` must be a multiple of ``2 * cp_size`` (:func:`zigzag_length_problem`); that is
sufficient for every split: the ring shard ``S / R`` is even (``2R`` chunks) and splits into ``U``
pieces of ``S / cp_size`` tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

Tensor = torch.Tensor

__all__ = [
    "cp_coordinates",
    "cp_gather",
    "cp_position_ids",
    "cp_shard",
    "cp_unshard",
    "local_length_problem",
    "ulysses_size_problem",
    "zigzag_chunk_ids",
    "zigzag_length_problem",
    "zigzag_padded_length",
]


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


def zigzag_chunk_ids(rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (out of ``2 * cp_size``) held by ``rank``."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} is outside 0..{cp_size - 1}")
    return rank, 2 * cp_size - 1 - rank


def _ring_shard(x: Tensor, rank: int, ring_size: int, dim: int) -> Tensor:
    """Ring rank ``rank``'s zigzag shard of ``x`` along ``dim``: chunks ``rank`` and
    ``2 * ring_size - 1 - rank`` of ``2 * ring_size``, concatenated."""
    chunks = x.chunk(2 * ring_size, dim=dim)
    first, second = zigzag_chunk_ids(rank, ring_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def _ring_unshard(shards: list[Tensor], dim: int) -> Tensor:
    """Inverse of :func:`_ring_shard`: the ring shards in ring rank order -> the global tensor."""
    ring_size = len(shards)
    chunks: list[Tensor | None] = [None] * (2 * ring_size)
    for rank, shard in enumerate(shards):
        problem = zigzag_length_problem(
            shard.shape[dim] * ring_size,
            ring_size,
            subject=f"shard of rank {rank} (length {shard.shape[dim]})",
        )
        if problem:
            raise ValueError(problem)
        first, second = zigzag_chunk_ids(rank, ring_size)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def ulysses_size_problem(cp_size: int, ulysses_size: int) -> str | None:
    """Why ``ulysses_size`` cannot split a CP group of ``cp_size`` ranks (``None`` when it can)."""
    if cp_size < 1:
        return f"cp_size must be >= 1, got {cp_size}"
    if ulysses_size < 1 or cp_size % ulysses_size:
        sizes = [u for u in range(1, cp_size + 1) if cp_size % u == 0]
        return (
            f"ulysses_size={ulysses_size} does not divide cp_size={cp_size} (cp_size = ulysses_size x "
            f"ring_size): use one of {sizes}"
        )
    return None


def _check(seq_len: int, cp_size: int, ulysses_size: int) -> None:
    problem = ulysses_size_problem(cp_size, ulysses_size) or zigzag_length_problem(
        seq_len, cp_size, fix=f"pad it to a multiple of {2 * cp_size} (RingDataCollator pads automatically)"
    )
    if problem:
        raise ValueError(problem)


def cp_coordinates(cp_rank: int, cp_size: int, ulysses_size: int = 1) -> tuple[int, int]:
    """``(ring_rank, ulysses_rank)`` of CP rank ``cp_rank``: ``cp_rank = ring_rank * ulysses_size +
    ulysses_rank``."""
    problem = ulysses_size_problem(cp_size, ulysses_size)
    if problem:
        raise ValueError(problem)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    return divmod(cp_rank, ulysses_size)


def cp_shard(x: Tensor, cp_rank: int, cp_size: int, ulysses_size: int = 1, dim: int = 1) -> Tensor:
    """CP rank ``cp_rank``'s tokens of ``x`` along ``dim`` (default 1): ``(batch, seq, ...)`` ->
    ``(batch, seq // cp_size, ...)``: piece ``u`` of ``U`` of ring rank ``p``'s zigzag shard."""
    _check(x.shape[dim], cp_size, ulysses_size)
    ring_rank, ulysses_rank = cp_coordinates(cp_rank, cp_size, ulysses_size)
    ring_shard = _ring_shard(x, ring_rank, cp_size // ulysses_size, dim)
    piece = x.shape[dim] // cp_size
    return ring_shard.narrow(dim, ulysses_rank * piece, piece)


def cp_unshard(shards: list[Tensor] | tuple[Tensor, ...], ulysses_size: int = 1, dim: int = 1) -> Tensor:
    """Inverse of :func:`cp_shard`: ``cp_size`` shards ``(batch, seq // cp_size, ...)`` in CP rank
    order -> the global ``(batch, seq, ...)``."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("cp_unshard needs at least one shard")
    problem = ulysses_size_problem(cp_size, ulysses_size)
    if problem:
        raise ValueError(problem)
    ring_shards = [
        torch.cat(list(shards[p * ulysses_size : (p + 1) * ulysses_size]), dim=dim)
        for p in range(cp_size // ulysses_size)
    ]
    return _ring_unshard(ring_shards, dim)


def cp_position_ids(seq_len: int, cp_rank: int, cp_size: int, ulysses_size: int = 1, device=None) -> Tensor:
    """Global positions ``(seq_len // cp_size,)`` (int64, increasing) of the tokens CP rank
    ``cp_rank`` holds."""
    return cp_shard(torch.arange(seq_len, device=device), cp_rank, cp_size, ulysses_size, dim=0)


def cp_gather(x: Tensor, group=None, ulysses_size: int = 1, dim: int = 1) -> Tensor:
    """All-gather every CP rank's shard (e.g. logits ``(batch, seq_local, vocab)``) over the CP
    ``group`` into global order ``(batch, seq, vocab)``. Not differentiable (inference helper)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x, group=group)
    return cp_unshard(pieces, ulysses_size, dim=dim)
