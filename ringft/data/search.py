"""Search over a monotone size parameter: the largest size whose text still fits a token budget.

Shared by line retrieval's record fitting and the long-context tasks' haystack fitting.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["largest_fitting"]


def largest_fitting(fits: Callable[[int], bool], guess: int, low: int = 1) -> int:
    """Largest ``n >= low`` with ``fits(n)``, for ``fits`` true up to some n and false after it.

    Requires ``fits(low)``. Steps out from ``guess`` with doubling steps until the answer is
    bracketed, then bisects: ``O(log |answer - guess|)`` calls. If ``fits`` is not monotone the
    result still fits and ``n + 1`` does not.
    """
    step = 1
    guess = max(guess, low)
    if fits(guess):
        lo = guess
        while fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi = guess
        while hi - step > low and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(low, hi - step)
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
