"""The longest input that fits a token budget: searches over a monotone size parameter.

A generator renders its text from one integer *size* (record lines, noise lines, essay words, ...);
the fitted size is the largest ``n`` whose token count is at most the budget. :func:`largest_fitting`
needs only a yes/no test (doubling steps out from a guess, then bisection); :func:`largest_size`
reads the counts themselves and interpolates between sizes that fit and sizes that do not (a few
tokenizations when the count is close to linear in the size), finishing by bisection. Line-retrieval
records (:func:`ringft.data.line_retrieval.record.fit_record`) and the long-context tasks' prompts
(:func:`ringft.evals.long_tasks.prompt.fit_text`) are fitted with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["largest_fitting", "largest_size"]


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


_PROBE = 16  # size of the first probe when there is no hint
_ROUNDS = 8  # interpolation rounds before falling back to bisection


def largest_size(measure: Callable[[int], int], budget: int, minimum: int, hint: int | None = None) -> int:
    """Largest ``n >= minimum`` with ``measure(n) <= budget``; ``measure(minimum)`` must fit.

    ``measure(n)`` is the token count at size ``n`` (callers cache it: every size is measured once
    here only if they do). Starts from ``hint`` (e.g. the previous sample's size) or a linear
    extrapolation from a small probe, then interpolates between the sizes known to fit and not to
    fit (regula falsi) and finishes by bisection.
    """
    if hint is None:
        smallest = measure(minimum)
        probe = minimum + _PROBE
        while measure(probe) == smallest and probe - minimum < 1 << 20:  # a size step can add no token
            probe = minimum + 2 * (probe - minimum)
        hint = _predict(minimum, smallest, probe, measure(probe), budget)
    return _interpolate(measure, budget, minimum, max(hint, minimum + 1))


def _predict(n0: int, c0: int, n1: int, c1: int, budget: int) -> int:
    """Largest size at or under ``budget`` on the line through ``(n0, c0)`` and ``(n1, c1)``."""
    slope = max(1e-9, (c1 - c0) / (n1 - n0))
    return n0 + math.floor((budget - c0) / slope)


def _interpolate(measure: Callable[[int], int], budget: int, minimum: int, start: int) -> int:
    """Largest ``n >= minimum`` with ``measure(n) <= budget`` (``measure(minimum)`` fits)."""
    lo, hi, n = minimum, None, start
    for _ in range(_ROUNDS):
        if measure(n) <= budget:
            lo = n
        else:
            hi = n
        if hi is not None and hi - lo <= 1:
            return lo
        # Each probe lies strictly inside the bracket, so lo only grows and hi only shrinks.
        n0, n1 = (minimum, lo) if hi is None else (lo, hi)
        n = max(lo + 1, _predict(n0, measure(n0), n1, measure(n1), budget))
        n = min(n, hi - 1) if hi is not None else min(n, 4 * lo + 64)  # no runaway on a flat count
    if hi is None:
        return largest_fitting(lambda m: measure(m) <= budget, lo, lo)
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if measure(mid) <= budget else (lo, mid)
    return lo
