"""Padding fraction of ringft's one packer (``ringft.data.packer.pack_rows``) against the two rules it
replaced, on the same length distributions, in one run.

The old rules are reimplemented here as they were:

- ``ffd``: the packing collator's first-fit decreasing (longest first, each into the *first* row
  with room; a linear scan of the rows);
- ``bfd-old``: ``pack_examples``' inline best-fit decreasing (longest first, each into the
  *fullest* row it fits). ``pack_rows`` keeps that rule and its sorted list of rooms, so this copy
  finds the row by a scan instead (same rows; its time column is a scan's).

Two regimes: a whole dataset packed at once (``pack_examples`` on tokenized SFT examples: 20,000) and
per-batch packing in the collator (``RingDataCollator(packing=True)``: 16 examples per call, 500
calls). Padding fraction = 1 - tokens / (rows * row length); lower is better. Bound: the rows no rule
can beat (``ceil(tokens / row length)`` per call); for the first ``--exact`` collator calls the true
optimum is also found by exact search, to show how far any rule could still get. Time: host
milliseconds per call, minimum of interleaved repeats (``cp_size=1``: no zigzag balancing).

Usage: ``python benchmarks/bench_packing.py [--corpus 20000] [--batch 16] [--batches 500]``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe_machine  # noqa: E402
from ringft.data.packer import pack_rows  # noqa: E402

Packer = Callable[[Sequence[int], int], list[list[int]]]


def _decreasing(lengths: Sequence[int], capacity: int, pick: Callable[[list[tuple[int, int]]], int]):
    """Longest first, each item into the row ``pick`` chooses among ``(room, row)`` of the rows it
    fits (a new row when none): the shape both old rules shared, with a scan of every open row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [(free, r) for r, free in enumerate(room) if free >= lengths[i]]
        if fits:
            row = pick(fits)
        else:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit decreasing, the rule ``pack_rows`` is compared with: the first row with room (a
    scan of the rows)."""
    return _decreasing(lengths, capacity, lambda fits: fits[0][1])


def old_best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best fit decreasing by a scan: the fullest row it fits, ties to the earliest (``pack_rows``
    keeps the rooms in a sorted list; this copy scans, so its time column is a scan's)."""
    return _decreasing(lengths, capacity, lambda fits: min(fits)[1])


PACKERS: dict[str, Packer] = {
    "ffd (old collator)": first_fit_decreasing,
    "bfd (old pack_examples)": old_best_fit_decreasing,
    "pack_rows (new)": lambda lengths, capacity: pack_rows(lengths, capacity),
}


def _lognormal(median: float, sigma: float) -> Callable[[random.Random, int], int]:
    return lambda rng, cap: min(cap, max(1, round(rng.lognormvariate(0.0, sigma) * median)))


def _bimodal(rng: random.Random, cap: int) -> int:
    if rng.random() < 0.8:
        return rng.randint(32, 400)  # short turns / snippets
    return rng.randint(cap // 4, cap)  # long documents


# name -> (row length, draw(rng, row length) -> one example's length)
DISTRIBUTIONS: dict[str, tuple[int, Callable[[random.Random, int], int]]] = {
    "SFT chats, lognormal median 600 (sigma 1.0), rows 4K": (4096, _lognormal(600, 1.0)),
    "SFT chats, lognormal median 600 (sigma 1.0), rows 16K": (16384, _lognormal(600, 1.0)),
    "web documents, lognormal median 2K (sigma 1.3), rows 32K": (32768, _lognormal(2048, 1.3)),
    "80% short (32-400) + 20% long (1/4 row - row), rows 8K": (8192, _bimodal),
    "uniform 1 - row, rows 4K": (4096, lambda rng, cap: rng.randint(1, cap)),
}


def _padding(packer: Packer, batches: list[list[int]], capacity: int) -> tuple[float, int]:
    """(padding fraction over all batches, rows), after checking every packing is valid."""
    rows, tokens = 0, 0
    for lengths in batches:
        bins = packer(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        rows += len(bins)
        tokens += sum(lengths)
    return 1.0 - tokens / (rows * capacity), rows


def _ms_per_call(packer: Packer, batches: list[list[int]], capacity: int) -> float:
    start = time.perf_counter()
    for lengths in batches:
        packer(lengths, capacity)
    return 1e3 * (time.perf_counter() - start) / len(batches)


def _fits(lengths: Sequence[int], capacity: int, rows: int, budget: int) -> bool | None:
    """Whether ``lengths`` fit in ``rows`` rows (exact depth-first search; None past ``budget`` nodes)."""
    items, rooms, nodes = sorted(lengths, reverse=True), [capacity] * rows, [0]

    def place(i: int) -> bool:
        nodes[0] += 1
        if nodes[0] > budget:
            raise TimeoutError
        if i == len(items):
            return True
        for r in {room: k for k, room in enumerate(rooms) if room >= items[i]}.values():  # one per room
            rooms[r] -= items[i]
            if place(i + 1):
                return True
            rooms[r] += items[i]
        return False

    try:
        return place(0)
    except TimeoutError:
        return None


def _optimum(batches: list[list[int]], capacity: int, budget: int = 200_000) -> tuple[int, int]:
    """(fewest rows found by exact search below pack_rows' count, batches left undecided)."""
    total, undecided = 0, 0
    for lengths in batches:
        best = len(pack_rows(lengths, capacity))
        for rows in range(-(-sum(lengths) // capacity), best):
            verdict = _fits(lengths, capacity, rows, budget)
            if verdict is None:
                undecided += 1
            if verdict is not False:
                best = rows if verdict else best
                break
        total += best
    return total, undecided


def main() -> None:
    """Print one table: padding fraction (and rows) per packer, the bound, and time per call."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=int, default=20000, help="examples packed at once")
    parser.add_argument("--batch", type=int, default=16, help="examples per collator call")
    parser.add_argument("--batches", type=int, default=500, help="collator calls")
    parser.add_argument("--repeats", type=int, default=3, help="timing: minimum of interleaved repeats")
    parser.add_argument("--exact", type=int, default=100, help="collator calls also solved exactly")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(describe_machine())
    print(f"corpus: {args.corpus} examples at once; collator: {args.batches} x {args.batch} examples\n")
    names = list(PACKERS)
    head = " | ".join(f"{n}: padding (rows)" for n in names)
    print(f"| lengths | regime | {head} | bound: padding (rows) | ms / call, same order |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    optimal = []
    for dist_name, (capacity, draw) in DISTRIBUTIONS.items():
        rng = random.Random(args.seed)
        regimes = {
            "corpus": [[draw(rng, capacity) for _ in range(args.corpus)]],
            "collator": [[draw(rng, capacity) for _ in range(args.batch)] for _ in range(args.batches)],
        }
        for regime, batches in regimes.items():
            cells = []
            for name in names:
                pad, rows = _padding(PACKERS[name], batches, capacity)
                cells.append(f"{100 * pad:.3f} % ({rows})")
            bound_rows = sum(-(-sum(lengths) // capacity) for lengths in batches)  # no rule can use fewer
            bound = 1.0 - sum(map(sum, batches)) / (bound_rows * capacity)
            ms = {n: float("inf") for n in names}
            for rep in range(args.repeats):
                for name in names if rep % 2 == 0 else names[::-1]:
                    ms[name] = min(ms[name], _ms_per_call(PACKERS[name], batches, capacity))
            times = " / ".join(f"{ms[n]:.2f}" for n in names)
            bound_cell = f"{100 * bound:.3f} % ({bound_rows})"
            print(f"| {dist_name} | {regime} | {' | '.join(cells)} | {bound_cell} | {times} |")
        exact = regimes["collator"][: args.exact]
        rows, undecided = _optimum(exact, capacity)
        ours = sum(len(pack_rows(lengths, capacity)) for lengths in exact)
        optimal.append(f"- {dist_name}: pack_rows {ours} rows, optimum {rows} ({undecided} undecided)")
    print(f"\nExact optimum of the first {args.exact} collator calls (depth-first search):")
    print("\n".join(optimal))


if __name__ == "__main__":
    main()
