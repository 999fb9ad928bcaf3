"""A task's prompt: its text at one size (:class:`Rendered`), in the chat template, fitted to a budget.

Every task renders its text from one integer *size* (noise lines, essay words, listed words,
characters of noise, ...), deterministically from the sample's seed. The fitted size is the largest
``n >= minimum`` whose final prompt has at most ``budget`` tokens (:func:`ringft.data.fit.largest_size`).

Token counting: the prompt is the task text in one user turn of the tokenizer's chat template
(when used), followed by the answer prefix, and its tokens are the ids the model is fed:
``encode_prompt(tokenizer, prompt, chat_template)`` (BOS counted for raw prompts; a chat template
writes its own). RULER counts ``tokenizer.tokenize(text)`` of the same text, which never includes
a BOS the tokenizer would add, so a raw prompt here may hold one token less text than RULER's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringft.data.fit import largest_size
from ringft.data.tokenizer import apply_template, encode_prompt

__all__ = ["FittedText", "LengthTooShortError", "Rendered", "fit_text", "render_prompt"]


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

    Starts from ``hint`` (e.g. the previous sample's size); see :func:`ringft.data.fit.largest_size`.
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
    size = largest_size(measure, budget, minimum, hint)
    count, rendered, text, prompt = cache[size]
    return FittedText(size, rendered, text, prompt, count)
