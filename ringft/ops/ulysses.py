"""Ulysses x ring attention (2D context parallelism, "USP"): exact attention on the CP layout of
:mod:`ringft.ops.sharding` (``cp_size = ulysses_size x ring_size``).

Each call:

1. one all-to-all over the Ulysses group turns q/k/v from sequence shards ``(B, S/cp, H, D)`` into
   head shards ``(B, S/R, H/U, D)`` (the ring shard, pieces in order); K/V travel at their own
   (GQA) head count;
2. zigzag ring attention (:func:`ringft.ops.zigzag.zigzag_ring_attention`) runs over the ring group
   with this rank's heads; packed documents (global ``cu_seqlens``) are handled there;
3. one all-to-all brings the output back to ``(B, S/cp, H, D)``.

The backward takes the same route (the all-to-alls' own backward in :mod:`ringft.ops.alltoall`,
then the ring's). ``ulysses_size = 1`` *is* the ring (the same call); ``ring_size = 1`` is pure
Ulysses. K/V heads: when ``ulysses_size`` does not divide them, each K/V head is repeated the
fewest times that make it divide (``U / gcd(U, H_kv)``; logged once); query heads must be a
multiple of ``ulysses_size``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from ringft.ops.alltoall import heads_to_seq, seq_to_heads
from ringft.ops.documents import DocumentLayout, check_cu_seqlens
from ringft.ops.dtypes import follow_autocast
from ringft.ops.parallel import ParallelLayout
from ringft.ops.ring_checks import local_input_problems, offsets_checksum
from ringft.ops.validate import DTYPE_CODES, exchange_facts, raise_if_facts_differ, raise_problems
from ringft.ops.zigzag import zigzag_ring_attention

Tensor = torch.Tensor

__all__ = ["heads_problem", "kv_replication", "ulysses_ring_attention", "ulysses_sizes_that_work"]

_log = logging.getLogger(__name__)
_WARNED: set[tuple[int, int]] = set()


def kv_replication(kv_heads: int, ulysses_size: int) -> int:
    """How many copies of each K/V head the all-to-all sends so that ``ulysses_size`` ranks get
    equal whole K/V heads: ``U / gcd(U, H_kv)`` (1 when ``U`` divides ``H_kv``). It divides the
    GQA group size whenever ``U`` divides the query heads, so GQA stays exact."""
    return ulysses_size // math.gcd(ulysses_size, kv_heads)


def ulysses_sizes_that_work(heads: int, cp_size: int | None = None) -> list[int]:
    """The Ulysses sizes that split ``heads`` query heads (and divide ``cp_size`` when given)."""
    limit = heads if cp_size is None else min(heads, cp_size)
    return [u for u in range(1, limit + 1) if heads % u == 0 and (cp_size is None or cp_size % u == 0)]


def heads_problem(heads: int, ulysses_size: int, cp_size: int | None = None) -> str | None:
    """Why ``ulysses_size`` cannot split ``heads`` query heads (``None`` when it can)."""
    if heads % ulysses_size:
        where = "" if cp_size is None else f" and cp_size={cp_size}"
        return (
            f"query heads ({heads}) are not divisible by ulysses_size={ulysses_size}: use a ulysses_size "
            f"dividing the heads{where}: {ulysses_sizes_that_work(heads, cp_size)}"
        )
    return None


def _document_problems(q: Tensor, cu_seqlens, causal: bool, sizes, ranks) -> list[str]:
    (u_size, r_size, cp_size), (_, r_rank, _) = sizes, ranks
    if cu_seqlens is None or q.dim() != 4:
        return []
    if not causal:
        return ["cu_seqlens (packed documents) needs causal=True"]
    if isinstance(cu_seqlens, DocumentLayout):
        documents = cu_seqlens
        if (documents.rank, documents.cp_size, len(documents.rows), documents.rows[0].diagonal[-1]) != (
            r_rank, r_size, q.shape[0], q.shape[1] * u_size,
        ):  # fmt: skip
            return [
                f"the DocumentLayout must be built for ring rank {r_rank} of ring_size {r_size} "
                "(document_layout(cu_seqlens, seq_len, ring_rank, ring_size))"
            ]
        return []
    return check_cu_seqlens(cu_seqlens, q.shape[1] * cp_size, q.shape[0])


def _problems(q, k, v, backend, cu_seqlens, causal, groups: ParallelLayout) -> list[str]:
    sizes, ranks, layout = groups.group_sizes(), groups.group_ranks(), groups.problem()
    problems = ([layout] if layout else []) + local_input_problems(q, k, v, backend, sizes[2])
    if q.dim() == 4:
        head = heads_problem(q.shape[2], sizes[0], sizes[2])
        problems += [head] if head else []
    return problems + _document_problems(q, cu_seqlens, causal, sizes, ranks)


def _validate(q, k, v, backend, cu_seqlens, causal, groups: ParallelLayout) -> None:
    """The same ``ValueError`` on every CP rank when any rank's inputs are unusable or disagree:
    one small all_gather over the CP group before any all-to-all or ring traffic."""
    (u_size, r_size, _), (_, _, cp_rank) = groups.group_sizes(), groups.group_ranks()
    shape = (*q.shape, k.shape[2]) if q.dim() == 4 and k.dim() == 4 else (-1,) * 5
    facts = (*shape, DTYPE_CODES.get(q.dtype, 0), offsets_checksum(cu_seqlens), u_size, r_size)
    problems = _problems(q, k, v, backend, cu_seqlens, causal, groups)
    rows = exchange_facts((int(bool(problems)),), facts, group=groups.cp_group, device=q.device)
    where = "ulysses_ring_attention"
    raise_problems(where, problems, [bool(bad) for (bad,), _ in rows], cp_rank)
    raise_if_facts_differ(
        where,
        [theirs for _, theirs in rows],
        "(batch, seq_local, heads, dim, kv_heads, dtype, cu_seqlens checksum, ulysses, ring)",
        "all CP ranks must pass the same batch, seq_local (S / cp_size), heads, head_dim, dtype, "
        "cu_seqlens and layout. Shard every sequence with cp_shard / RingDataCollator",
    )


def _replicate_kv(k: Tensor, v: Tensor, ulysses_size: int) -> tuple[Tensor, Tensor]:
    copies = kv_replication(k.shape[2], ulysses_size)
    if copies == 1:
        return k, v
    key = (k.shape[2], ulysses_size)
    if key not in _WARNED:
        _WARNED.add(key)
        _log.warning(
            "ulysses_ring_attention: ulysses_size=%d does not divide the %d K/V heads; each K/V head is "
            "sent %d times (%d K/V heads, %d per rank), which multiplies K/V all-to-all and ring traffic "
            "by %d. A ulysses_size that divides the K/V heads avoids it.",
            ulysses_size, k.shape[2], copies, k.shape[2] * copies, k.shape[2] * copies // ulysses_size,
            copies,
        )  # fmt: skip
    return k.repeat_interleave(copies, dim=2), v.repeat_interleave(copies, dim=2)


def ulysses_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    groups: ParallelLayout | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    validate: bool = True,
    cu_seqlens: Sequence[Sequence[int]] | DocumentLayout | None = None,
    **ring_options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded on the Ulysses x ring layout.

    Args:
        q: ``(batch, seq_local, heads_q, head_dim)``, this CP rank's tokens (:func:`cp_shard`).
        k, v: ``(batch, seq_local, heads_kv, head_dim)``, GQA (``heads_q % heads_kv == 0``).
        groups: the layout whose Ulysses, ring and CP groups to use (:func:`build_layout`, or
            ``ParallelLayout.from_groups``). ``None``: no Ulysses split, the zigzag ring over the
            default group (:func:`zigzag_ring_attention`).
        causal, softmax_scale, backend: as for :func:`zigzag_ring_attention`.
        return_lse: also return the log-sum-exp ``(batch, heads_q, seq_local)`` in fp32.
        validate: check every CP rank's inputs and layout together first (one small all_gather over
            the CP group); ``False`` keeps only this rank's own checks, for callers that validated.
        cu_seqlens: packed documents as global offsets per row (every rank the same), or a
            ``DocumentLayout`` built for this rank's *ring* rank and ``ring_size``.
        ring_options: passed on to :func:`zigzag_ring_attention` unchanged.

    Returns:
        ``out`` ``(batch, seq_local, heads_q, head_dim)`` in q's dtype (the autocast dtype under
        autocast), and ``lse`` if asked.
    """
    if groups is None or (groups.group_sizes()[0] == 1 and groups.problem() is None):
        ring = None if groups is None else groups.ring_group
        return zigzag_ring_attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, group=ring, backend=backend,
            return_lse=return_lse, validate=validate, cu_seqlens=cu_seqlens, **ring_options,
        )  # fmt: skip
    q, k, v = follow_autocast(q, k, v)  # the all-to-alls carry the autocast dtype
    if validate:
        _validate(q, k, v, backend, cu_seqlens, causal, groups)
    else:
        problems = _problems(q, k, v, backend, cu_seqlens, causal, groups)
        if problems:
            where = f"ulysses_ring_attention: CP rank {groups.group_ranks()[2]}: "
            raise ValueError(where + "; ".join(problems))
    size = groups.group_sizes()[0]
    k, v = _replicate_kv(k, v, size)
    qh, kh, vh = seq_to_heads(q, k, v, group=groups.ulysses_group, size=size)
    out, lse = zigzag_ring_attention(
        qh, kh, vh, causal=causal, softmax_scale=softmax_scale, group=groups.ring_group, backend=backend,
        return_lse=True, validate=False, cu_seqlens=cu_seqlens, **ring_options,
    )  # fmt: skip
    (out,) = heads_to_seq(out, group=groups.ulysses_group, size=size)
    if not return_lse:
        return out
    with torch.no_grad():
        (lse,) = heads_to_seq(lse.transpose(1, 2).unsqueeze(-1), group=groups.ulysses_group, size=size)
    return out, lse.squeeze(-1).transpose(1, 2).contiguous()
