"""The one packer: which examples share a row, and in which order (:func:`pack_rows`).

Every packing caller uses it: the packing collator (``RingDataCollator(packing=True)``) and
:func:`ringft.data.pack_corpus.pack_examples` (tokenized SFT examples with their offsets). Rule: best-fit
decreasing (longest example first, each into the fullest row it fits, ties to the earliest row),
which uses at most ``11/9 OPT + 6/9`` rows; on the lengths of ``benchmarks/bench_packing.py`` it
packs exactly as tightly as the collator's old first-fit rule, in ``O(n log n)`` instead of a scan
of every open row per example. Inside a row the order is free (documents are masked
apart), so with ``cp_size > 1`` it is chosen to even out the zigzag ranks' attention work
(:func:`balanced_order`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from ringft.ops.documents import rank_pairs

__all__ = ["balanced_order", "pack_rows", "padding_fraction"]


def pack_rows(lengths: Sequence[int], capacity: int, cp_size: int = 1) -> list[list[int]]:
    """Item indices per row: items of ``lengths`` (each ``<= capacity``) packed into rows of
    ``capacity`` tokens by best-fit decreasing, each row ordered by :func:`balanced_order` for
    ``cp_size`` zigzag ranks (kept in packing order when ``cp_size == 1``). Deterministic.

    Raises ``ValueError`` for an item longer than ``capacity`` (callers name it first).
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(
            f"item {too_long[0]} has {lengths[too_long[0]]} tokens, more than a row ({capacity})"
        )
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), ascending: the fullest row that fits is first
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = free.pop(at)
        rows[row].append(i)
        bisect.insort(free, (room - lengths[i], row))
    if cp_size > 1:
        rows = [[m[j] for j in balanced_order([lengths[i] for i in m], capacity, cp_size)] for m in rows]
    return rows


def padding_fraction(lengths: Sequence[int], rows: Sequence[Sequence[int]], capacity: int) -> float:
    """Share of the ``len(rows) * capacity`` tokens that are padding (0.0 for no rows)."""
    return 1.0 - sum(lengths) / (len(rows) * capacity) if rows else 0.0


def balanced_order(
    lengths: Sequence[int], seq_len: int, cp_size: int, tries: int = 48, seed: int = 0
) -> list[int]:
    """An order of the documents ``lengths`` (indices) that evens out the zigzag ranks' work.

    Zigzag balances one causal sequence; packed documents break that (a rank whose chunks hold one
    long document does far more than a rank holding many short ones). Any order is exact, so
    this tries the given order, seeded shuffles, then swaps among the longest documents, and keeps
    the order with the smallest busiest-rank pair count. Deterministic; host integers only.
    """
    order = list(range(len(lengths)))
    if cp_size == 1 or len(order) < 2:
        return order
    cost = lambda o: max(rank_pairs([lengths[i] for i in o], seq_len, cp_size))  # noqa: E731
    rng = random.Random(seed)
    best, best_cost = order, cost(order)
    for _ in range(tries):
        candidate = rng.sample(order, len(order))
        c = cost(candidate)
        if c < best_cost:
            best, best_cost = candidate, c
    longest = sorted(order, key=lambda i: -lengths[i])[:10]
    where = {i: best.index(i) for i in longest}
    for a_i, a in enumerate(longest):
        for b in longest[a_i + 1 :]:
            candidate = list(best)
            candidate[where[a]], candidate[where[b]] = b, a
            c = cost(candidate)
            if c < best_cost:
                best, best_cost = candidate, c
                where[a], where[b] = where[b], where[a]
    return best
