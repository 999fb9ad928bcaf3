"""Sliding windows on the zigzag ring: which chunks meet, and which K/V travel where.

Convention (transformers' ``sliding_window``, ``masking_utils.sliding_window_overlay``): query
position ``i`` sees key positions ``j`` with ``i - window < j <= i`` -- ``window`` keys, itself
included. ``window >= S`` is plain causal attention.

Zigzag layout: ``2N`` chunks of ``c = S / 2N`` tokens, rank ``r`` holds chunks ``r`` and
``2N-1-r``. Query chunk ``X`` meets key chunk ``Y < X`` iff ``(X - Y - 1) * c + 1 <= window - 1``,
i.e. the ``k = ceil((window - 1) / c)`` chunks before it. So rank ``r`` needs

- the *first* chunk of rank ``j < r`` when ``r - j <= k`` (for its chunk ``r``), or when
  ``2N-1-r - j <= k`` (its chunk ``2N-1-r`` near the middle of the sequence);
- the *second* chunk of rank ``j > r`` when ``j - r <= k`` (chunk ``2N-1-j`` sits just before
  ``2N-1-r``);

and nothing else. The schedule (:class:`WindowSchedule`) is a *distance-s exchange*: at step
``s = 1..steps`` every rank sends to ranks ``r + s`` and ``r - s`` exactly the chunks they need from
it and receives what it needs from them, in one ``batch_isend_irecv``, posted one step ahead so it
overlaps with the previous step's compute. ``steps`` is the largest distance at which anything is
needed (``k`` in the bulk of the ring, fewer near its ends), so once no shard within the window
remains nothing travels. Per rank and layer, K/V sent = (chunks sent) x ``c`` tokens x 2 (K and V)
x batch x kv_heads x head_dim x itemsize: at most ``2k`` chunks (``k`` blocks) against the ring's
``N - 1`` full blocks, and never more than the ring even when ``window`` nearly spans ``S``. The
backward repeats the exchange and sends each received chunk's dK/dV (fp32) straight back to its
owner (the same pairs, reversed); a relay would send the same bytes over more hops.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ringft.ops.band import Band, band_pairs, trim_band

__all__ = [
    "WindowSchedule",
    "chunk_bands",
    "chunks_meet",
    "window_chunks",
    "window_schedule",
    "window_problems",
]


def window_problems(window) -> list[str]:
    """What is wrong with a ``sliding_window`` value (an int >= 1, or None for no window)."""
    if window is None:
        return []
    if isinstance(window, bool) or not isinstance(window, int):
        return [
            f"sliding_window must be an int >= 1 (the number of most recent keys each query sees, itself "
            f"included) or None, got {window!r} ({type(window).__name__})"
        ]
    if window < 1:
        return [f"sliding_window must be >= 1 (1 = each token sees only itself) or None, got {window}"]
    return []


def chunks_meet(x: int, y: int, chunk: int, window: int) -> bool:
    """Whether some query of global chunk ``x`` sees some key of chunk ``y`` (chunks of ``chunk``
    tokens, causal, within ``window``)."""
    return y == x or (y < x and (x - y - 1) * chunk + 1 <= window - 1)


@dataclass(frozen=True)
class WindowSchedule:
    """The windowed exchange of an ``cp_size``-rank ring over ``seq_len`` tokens.

    ``needs[r][j]``: the chunk slots (0: first, 1: second) of rank ``j`` that rank ``r`` sees;
    ``steps``: the number of exchange steps after the local step 0.
    """

    seq_len: int
    cp_size: int
    window: int
    needs: tuple[tuple[tuple[int, ...], ...], ...]
    steps: int

    @property
    def chunk(self) -> int:
        """Tokens per zigzag chunk, ``S / 2N``."""
        return self.seq_len // (2 * self.cp_size)

    def _peers(self, rank: int, step: int) -> list[int]:
        return [p for p in (rank - step, rank + step) if 0 <= p < self.cp_size and step > 0]

    def receives(self, rank: int, step: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(source rank, slots)`` that ``rank`` receives at ``step`` (lower source first)."""
        return [(p, self.needs[rank][p]) for p in self._peers(rank, step) if self.needs[rank][p]]

    def sends(self, rank: int, step: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(destination rank, slots of this rank)`` that ``rank`` sends at ``step``."""
        return [(p, self.needs[p][rank]) for p in self._peers(rank, step) if self.needs[p][rank]]

    def chunks_sent(self, rank: int) -> int:
        """K/V chunks (of ``chunk`` tokens, K and V each) ``rank`` sends per forward."""
        return sum(len(slots) for s in range(1, self.steps + 1) for _, slots in self.sends(rank, s))

    def kv_bytes_sent(self, rank: int, batch: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes of K and V ``rank`` sends per layer and forward (the backward sends as much again,
        plus the dK/dV of the same chunks in fp32)."""
        return 2 * self.chunks_sent(rank) * self.chunk * batch * kv_heads * head_dim * itemsize

    def attention_pairs(self, rank: int, cu_seqlens: Sequence[int] | None = None) -> int:
        """Visible (query, key) pairs of ``rank``'s queries (one batch row, packed documents
        ``cu_seqlens`` if given): the FLOP count / (4 * heads * head_dim)."""
        n, c = self.cp_size, self.chunk
        mine = (rank, 2 * n - 1 - rank)
        total = 0
        for x in mine:
            for y in range(2 * n):
                if chunks_meet(x, y, c, self.window):
                    total += sum(band_pairs(b) for b in chunk_bands(x, y, c, self.window, cu_seqlens, 0))
        return total


@lru_cache(maxsize=64)
def window_schedule(seq_len: int, cp_size: int, window: int) -> WindowSchedule:
    """The :class:`WindowSchedule` of ``cp_size`` ranks, ``seq_len`` tokens (a multiple of
    ``2 * cp_size``) and ``window`` (>= 1). Host integers only; the same on every rank."""
    n = cp_size
    c = seq_len // (2 * n)
    needs, steps = [], 0
    for r in range(n):
        row = []
        for j in range(n):
            slots = ()
            if j != r:
                slots = tuple(
                    slot
                    for slot, y in enumerate((j, 2 * n - 1 - j))
                    if any(chunks_meet(x, y, c, window) for x in (r, 2 * n - 1 - r))
                )
            if slots:
                steps = max(steps, abs(r - j))
            row.append(slots)
        needs.append(tuple(row))
    return WindowSchedule(seq_len, n, window, tuple(needs), steps)


def chunk_bands(
    x: int, y: int, chunk: int, window: int, cu_seqlens: Sequence[int] | None, q_base: int
) -> list[Band]:
    """The trimmed bands of query chunk ``x`` (its rows at ``q_base .. q_base + chunk`` of the local
    query block) against key chunk ``y`` (a ``chunk``-token key block), one per document that meets
    both (``cu_seqlens``: this batch row's global offsets, None for one document)."""
    q0, k0 = x * chunk, y * chunk
    delta = q0 - q_base - k0  # position of local query row 0 minus position of key 0
    if cu_seqlens is None:
        spans = [(q0, q0 + chunk, k0, k0 + chunk)]
    else:
        cu = cu_seqlens
        spans = []
        start = bisect.bisect_right(cu, k0) - 1  # the document holding the chunk's first key
        for d0, d1 in zip(cu[start:], cu[start + 1 :]):
            if d0 >= min(q0 + chunk, k0 + chunk):
                break
            a, b = max(q0, d0), min(q0 + chunk, d1)
            e, f = max(k0, d0), min(k0 + chunk, d1)
            if a < b and e < f:
                spans.append((a, b, e, f))
    bands = []
    for a, b, e, f in spans:
        band = trim_band(Band(a - delta - k0, b - delta - k0, e - k0, f - k0, delta, window))
        if band is not None:
            bands.append(band)
    return bands


def window_chunks(seq_len: int, cp_size: int, window: int) -> int:
    """``k = ceil((window - 1) / c)``: how many chunks before a query chunk its window reaches."""
    return math.ceil((window - 1) / (seq_len // (2 * cp_size)))
