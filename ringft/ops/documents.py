"""Packed documents on the zigzag ring: which query and key pieces of each ring step share a document.

A packed sequence of length ``S`` holds documents ``[cu[i], cu[i+1])`` (``cu_seqlens``, global
offsets ``0 = cu[0] < ... < cu[m] = S``); a token attends causally to the earlier tokens of its own
document only. Rank ``r`` of ``N`` holds global chunks ``A = r`` and ``B = 2N-1-r`` (each ``c = S/2N``
tokens), concatenated. Documents are intervals, which makes every piece of work one rectangle:

- Step 0 (the local block): local order is global order, and a document that meets both chunks
  covers everything between them, so each document's local tokens are one contiguous range and
  the block is a *varlen causal* attention with local boundaries :attr:`RowLayout.diagonal`.
- Step ``s > 0`` (K/V of rank ``j``): the K/V chunks precede the queries that see them, and only the
  one document that contains the first query position involved (global ``A*c`` when ``j < r``,
  ``B*c`` when ``j > r``) can reach back into them. The step is one unmasked rectangle
  ``q[q0:q1] x kv[k0:k1]`` (a prefix of the queries, a suffix of the K/V) or nothing at all.

Rows outside a rectangle get no contribution from that step (they are simply not merged), so no
fully masked row ever reaches a kernel. One document per row gives exactly the unmasked schedule.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringft.ops.sharding import zigzag_chunk_ids, zigzag_length_problem

Tensor = torch.Tensor

__all__ = [
    "DocumentLayout",
    "RowLayout",
    "check_cu_seqlens",
    "cu_seqlens_from_position_ids",
    "document_layout",
    "rank_pairs",
]

Rect = tuple[int, int, int, int]  # (q0, q1, k0, k1), local indices, half-open


@dataclass(frozen=True)
class RowLayout:
    """One batch row on one rank: ``diagonal`` = local document boundaries ``(0, ..., seq_local)``
    of the step-0 block; ``blocks[s]`` = the rectangle of ring step ``s`` (``None``: skipped;
    ``blocks[0]`` is unused)."""

    diagonal: tuple[int, ...]
    blocks: tuple[Rect | None, ...]


@dataclass(frozen=True)
class DocumentLayout:
    """The document structure of a batch as one rank of an ``N``-rank ring sees it.

    ``rows`` has one :class:`RowLayout` per batch row; ``uniform``: every row has the same layout (one
    kernel call covers the batch); ``single``: every row is one document (the unmasked schedule);
    ``offsets``: the global document offsets per batch row it was built from (sliding windows
    derive their own bands from them).
    """

    rows: tuple[RowLayout, ...]
    cp_size: int
    rank: int
    uniform: bool
    single: bool
    offsets: tuple[tuple[int, ...], ...] | None = None

    def attention_pairs(self) -> int:
        """(query, key) pairs this rank computes over the whole ring (the FLOP count / (4 * heads * dim))."""
        total = 0
        for row in self.rows:
            d = row.diagonal
            total += sum((b - a) * (b - a + 1) // 2 for a, b in zip(d, d[1:]))
            total += sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in filter(None, row.blocks[1:]))
        return total


def _full_blocks(row: RowLayout, rank: int) -> bool:
    seq_local = row.diagonal[-1]
    half = seq_local // 2
    for step, rect in enumerate(row.blocks[1:], start=1):
        source = (rank - step) % len(row.blocks)
        full = (0, seq_local, 0, half) if source < rank else (half, seq_local, 0, seq_local)
        if rect != full:
            return False
    return True


def check_cu_seqlens(cu_seqlens: Sequence[Sequence[int]], seq_len: int, batch: int) -> list[str]:
    """Problems with per-row global document offsets (one message each, naming the fix)."""
    if len(cu_seqlens) not in (1, batch):
        return [f"cu_seqlens has {len(cu_seqlens)} rows for a batch of {batch}: give one row per sequence"]
    problems = []
    for i, row in enumerate(cu_seqlens):
        row = list(row)
        if len(row) < 2 or row[0] != 0 or row[-1] != seq_len or any(b <= a for a, b in zip(row, row[1:])):
            problems.append(
                f"cu_seqlens row {i} must rise strictly from 0 to the global sequence length {seq_len}, got "
                f"{row[:6]}{'...' if len(row) > 6 else ''} (len {len(row)})"
            )
    return problems


def cu_seqlens_from_position_ids(position_ids: Tensor) -> list[list[int]]:
    """Global document offsets from global ``position_ids`` ``(batch, S)``: a document starts at
    index 0 and wherever the position is 0 (transformers' padding-free convention)."""
    starts = (position_ids == 0).cpu()
    starts[:, 0] = True
    length = position_ids.shape[1]
    return [row.nonzero().flatten().tolist() + [length] for row in starts]


def _row_layout(cu: Sequence[int], seq_len: int, rank: int, cp_size: int) -> RowLayout:
    a, b = zigzag_chunk_ids(rank, cp_size)
    c = seq_len // (2 * cp_size)

    def local(g: int) -> int:
        """Local index of global position ``g`` (in chunk a or b), or of the end of chunk a/b."""
        return g - a * c if g <= (a + 1) * c else c + g - b * c

    diagonal = {0, 2 * c}
    for x in cu[1:-1]:
        if a * c < x < (a + 1) * c or b * c < x < (b + 1) * c:
            diagonal.add(local(x))
        elif (a + 1) * c <= x <= b * c:
            diagonal.add(c)  # a document starts between the two local chunks

    def containing(g: int) -> tuple[int, int]:
        i = bisect.bisect_right(cu, g) - 1
        return cu[i], cu[i + 1]

    blocks: list[Rect | None] = [None]
    for step in range(1, cp_size):
        j = (rank - step) % cp_size
        if j < rank:  # all local queries x chunk j (kv local [0, c))
            start, end = containing(a * c)
            q_end = local(min(end, (b + 1) * c)) if end > b * c else local(min(end, (a + 1) * c))
            k_first = max(start, j * c)
            blocks.append((0, q_end, k_first - j * c, c) if start < (j + 1) * c else None)
        else:  # local chunk b x chunks j and 2N-1-j (kv local [0, 2c), increasing global)
            start, end = containing(b * c)
            q_end = c + min(end, (b + 1) * c) - b * c
            j2 = zigzag_chunk_ids(j, cp_size)[1]
            if start < (j + 1) * c:
                blocks.append((c, q_end, max(start, j * c) - j * c, 2 * c))
            elif start < (j2 + 1) * c:
                blocks.append((c, q_end, c + max(start, j2 * c) - j2 * c, 2 * c))
            else:
                blocks.append(None)
    return RowLayout(tuple(sorted(diagonal)), tuple(blocks))


def document_layout(
    cu_seqlens: Sequence[Sequence[int]], seq_len: int, rank: int, cp_size: int, batch: int | None = None
) -> DocumentLayout:
    """The :class:`DocumentLayout` of ``rank`` for global offsets ``cu_seqlens`` (one row per batch row,
    or one row for all ``batch`` rows) of sequences of ``seq_len`` tokens (a multiple of ``2 * cp_size``).

    Host integers only: O(documents x cp_size) per row. Raises ``ValueError`` on malformed offsets.
    """
    rows = [list(map(int, r)) for r in cu_seqlens]
    batch = len(rows) if batch is None else batch
    problems = check_cu_seqlens(rows, seq_len, batch)
    problems += [p for p in [zigzag_length_problem(seq_len, cp_size)] if p]
    if problems:
        raise ValueError("; ".join(problems))
    layouts = {}
    for r in rows:
        if tuple(r) not in layouts:
            layouts[tuple(r)] = _row_layout(r, seq_len, rank, cp_size)
    full = tuple(layouts[tuple(r)] for r in rows)
    full = full * batch if len(full) == 1 else full
    single = all(len(row.diagonal) == 2 and _full_blocks(row, rank) for row in layouts.values())
    offsets = tuple(map(tuple, rows)) * (batch if len(rows) == 1 else 1)
    return DocumentLayout(full, cp_size, rank, uniform=len(layouts) == 1, single=single, offsets=offsets)


def rank_pairs(lengths: Sequence[int], seq_len: int, cp_size: int) -> list[int]:
    """Attention pairs per rank when documents of ``lengths`` (in this order, then padding up to
    ``seq_len`` as one more document) are zigzag-sharded over ``cp_size`` ranks."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if cu[-1] < seq_len:
        cu.append(seq_len)
    return [document_layout([cu], seq_len, r, cp_size).attention_pairs() for r in range(cp_size)]
