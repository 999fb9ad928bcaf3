"""Fitting a task's haystack to a token budget: bisection over a monotone size parameter.

Every task renders its text from one integer *size* (noise lines, essay words, listed words,
characters of noise, ...), deterministically from the sample's seed. The fitted size is the largest
``n >= minimum`` whose final prompt has at most ``budget`` tokens; the search brackets the answer
by interpolating between sizes that fit and sizes that do not, then bisecting
(:func:`ringft.data.search.largest_fitting` when no upper bound is known yet).

Token counting: the prompt is the task text in one user turn of the tokenizer's chat template
(when used), followed by the answer prefix, and its tokens are the ids the model is fed:
``encode_prompt(tokenizer, prompt, chat_template)`` (BOS counted for raw prompts; a chat template
writes its own). RULER counts ``tokenizer.tokenize(text)`` of the same text, which never includes
a BOS the tokenizer would add, so a raw prompt here may hold one token less text than RULER's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringft.data.line_retrieval.text import apply_template, encode_prompt
from ringft.data.search import largest_fitting

__all__ = ["FittedText", "LengthTooShortError", "Rendered", "fit_text", "largest_fitting", "render_prompt"]


@dataclass(frozen=True)
class Rendered:
    """A task's text at one size: ``body`` (goes in the user turn), ``answer_prefix`` (appended after
    it, outside the chat template, as RULER does), the reference strings ``outputs``, the relative
    positions of the needles in the haystack (``needle_depths``, 0 = start, 1 = end) and, where the
    benchmark defines one, the exact continuation a correct model writes (``target``)."""

    body: str
    answer_prefix: str
    outputs: tuple[str, ...]
    needle_depths: tuple[float, ...] = ()
    target: str | None = None


class LengthTooShortError(ValueError):
    """The requested length cannot hold the task's smallest prompt."""

    def __init__(self, task: str, length: int, budget: int, smallest: int, reserve: int) -> None:
        super().__init__(
            f"{task}: length {length} leaves {budget} prompt tokens ({reserve} reserved for the answer), "
            f"but its smallest prompt has {smallest} tokens with this tokenizer; use a length of at "
            f"least {smallest + reserve} (this sample's smallest; samples differ, so leave some room)"
        )
        self.task, self.length, self.budget, self.smallest = task, length, budget, smallest


def render_prompt(tokenizer: Any, rendered: Rendered, chat_template: bool) -> tuple[str, str]:
    """``(input, prompt)``: the body in the chat template (if used) and that plus the answer prefix."""
    text = apply_template(tokenizer, rendered.body, chat_template)
    return text, text + rendered.answer_prefix


@dataclass(frozen=True)
class FittedText:
    """The fitted size, its rendering, the prompt's parts and its token count."""

    size: int
    rendered: Rendered
    input: str
    prompt: str
    num_tokens: int


def fit_text(
    render: Callable[[int], Rendered],
    tokenizer: Any,
    budget: int,
    chat_template: bool,
    minimum: int,
    hint: int | None = None,
    *,
    task: str = "task",
    length: int | None = None,
) -> FittedText:
    """The largest size ``n >= minimum`` whose prompt has at most ``budget`` tokens.

    Starts from ``hint`` (e.g. the previous sample's size) or a linear extrapolation from a small
    probe, then interpolates between the sizes known to fit and not to fit (regula falsi: a few
    full tokenizations when the count is close to linear in the size) and finishes by bisection.
    :class:`LengthTooShortError` when even ``minimum`` does not fit.
    """
    cache: dict[int, tuple[int, Rendered, str, str]] = {}

    def measure(n: int) -> int:
        if n not in cache:
            rendered = render(n)
            text, prompt = render_prompt(tokenizer, rendered, chat_template)
            cache[n] = (len(encode_prompt(tokenizer, prompt, chat_template)), rendered, text, prompt)
        return cache[n][0]

    smallest = measure(minimum)
    if smallest > budget:
        reserve = (length - budget) if length is not None else 0
        raise LengthTooShortError(task, length if length is not None else budget, budget, smallest, reserve)
    if hint is None:
        probe = minimum + _PROBE
        while measure(probe) == smallest and probe - minimum < 1 << 20:  # a size step can add no token
            probe = minimum + 2 * (probe - minimum)
        hint = _predict(minimum, smallest, probe, measure(probe), budget)
    size = _interpolate(measure, budget, minimum, max(hint, minimum + 1))
    count, rendered, text, prompt = cache[size]
    return FittedText(size, rendered, text, prompt, count)


_PROBE = 16  # size of the first probe when there is no hint
_ROUNDS = 8  # interpolation rounds before falling back to bisection


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
