"""The 2D context-parallel layout's index math: ``cp_size = ulysses_size x ring_size``.

CP rank ``c`` is ``(ring rank p, Ulysses rank u)`` with ``c = p * ulysses_size + u``: a Ulysses group
is ``ulysses_size`` contiguous CP ranks (inside a node), a ring group is the CP ranks of equal
Ulysses rank. Token ownership, for a global sequence of ``S`` tokens and ``R = ring_size``,
``U = ulysses_size``:

- the sequence is zigzag-sharded over the *ring*: cut into ``2R`` chunks, ring rank ``p`` owns
  chunks ``p`` and ``2R-1-p`` concatenated (its *ring shard*, ``S / R`` tokens);
- that ring shard is cut into ``U`` contiguous equal pieces; CP rank ``(p, u)`` holds piece ``u``
  (``S / cp_size`` tokens, in increasing global order).

Inside attention, an all-to-all over the Ulysses group gives each rank its ``1/U`` of the heads over
the whole ring shard (pieces ``0..U-1`` in order), which is exactly what zigzag ring attention of
``R`` ranks expects. ``ulysses_size = 1`` is today's zigzag layout (these functions then equal
``zigzag_shard`` / ``zigzag_unshard`` / ``zigzag_position_ids``); ``ring_size = 1`` is plain
contiguous sharding (pure Ulysses).

Divisibility: ``S`` must be a multiple of ``2 * cp_size`` (= ``2 * R * U``) - the same rule as the
ring alone, so a collator that pads to ``2 * cp_size`` needs no change. It is sufficient: the ring
shard ``S / R`` is even (``2R`` chunks) and splits into ``U`` pieces of ``S / cp_size`` tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringft.ops.sharding import zigzag_length_problem, zigzag_shard, zigzag_unshard

Tensor = torch.Tensor

__all__ = [
    "cp_coordinates",
    "cp_gather",
    "cp_position_ids",
    "cp_shard",
    "cp_unshard",
    "ulysses_size_problem",
]


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
    fix = f"pad it to a multiple of {2 * cp_size} (RingDataCollator pads automatically)"
    problem = ulysses_size_problem(cp_size, ulysses_size) or zigzag_length_problem(seq_len, cp_size, fix=fix)
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
    ring_shard = zigzag_shard(x, ring_rank, cp_size // ulysses_size, dim=dim)
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
    return zigzag_unshard(ring_shards, dim=dim)


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
