"""A line-retrieval record fitted to a token budget.

The number of lines is the largest whose tokenized prompt does not exceed the requested length
(exactly: ``tokens(n) <= target < tokens(n + 1)``), and the asked line sits at a relative *depth*
(0 = first line, 1 = last line).

Token counting convention: the prompt's tokens are ``encode_prompt(tokenizer, prompt,
chat_template)``, i.e. ``tokenizer(prompt, add_special_tokens=True)`` for raw prompts (so a BOS
is counted when the tokenizer adds one) and ``add_special_tokens=False`` when a chat template was
applied (chat templates write their own BOS as text).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringft.data.fit import largest_fitting
from ringft.data.line_retrieval.text import (
    RecordStream,
    _words_for,
    build_record_text,
    get_prompt_style,
    name_capacity,
    render_line,
)
from ringft.data.seeds import derive_seed
from ringft.data.tokenizer import apply_template, encode_prompt


def target_index_for_depth(depth: float, num_lines: int) -> int:
    """Line index for a relative depth: 0 -> first, 1 -> last, else round-half-up."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if num_lines < 1:
        raise ValueError("num_lines must be >= 1")
    return min(num_lines - 1, math.floor(depth * (num_lines - 1) + 0.5))


def _line_token_counts(tokenizer: Any, lines: Sequence[str]) -> list[int]:
    """Standalone token count of each line (no special tokens), one batched call."""
    if not lines:
        return []
    enc = tokenizer(list(lines), add_special_tokens=False, verbose=False)
    return [len(ids) for ids in enc["input_ids"]]


_PROBE_LINES = 32  # lines tokenized to estimate how many lines can fit (sets the name width)


class RecordTooShortError(ValueError):
    """``target_tokens`` cannot hold even one record line (``shortest``: a one-line prompt's tokens)."""

    def __init__(self, target_tokens: int, shortest: int) -> None:
        super().__init__(
            f"{target_tokens} tokens cannot hold one record line: the one-line record has "
            f"{shortest} tokens with this tokenizer, template and prompt style"
        )
        self.target_tokens, self.shortest = target_tokens, shortest


class _NamesExhausted(Exception):
    """The record needs more lines than its name width can name uniquely."""


class _RecordFitter:
    """Finds the line count ``n`` with ``tokens(n) <= target < tokens(n + 1)``, where ``tokens(n)``
    is the full tokenization of the final prompt holding the stream's first ``n`` lines.

    Prefix sums of the standalone per-line token counts give a first guess (exact for tokenizers
    that are additive on line boundaries); full tokenizations then confirm it, stepping out with
    doubling steps until the answer is bracketed and bisecting the bracket (``largest_fitting``).
    """

    def __init__(
        self, tokenizer: Any, stream: RecordStream, depth: float, chat_template: bool, prompt_style: str
    ) -> None:
        self.tokenizer, self.stream, self.depth = tokenizer, stream, depth
        self.chat_template, self.prompt_style = chat_template, prompt_style
        self.prefix = [0]  # prefix[i] = summed standalone token counts of the first i lines
        self.counts: dict[int, int] = {}

    def extend(self, num_lines: int) -> None:
        """Generate (and count) lines up to ``num_lines``."""
        have = len(self.stream)
        if num_lines <= have:
            return
        if num_lines > name_capacity(self.stream.num_words) // 2:
            raise _NamesExhausted
        self.stream.ensure(num_lines)
        names, numbers = self.stream.names, self.stream.numbers
        new = [render_line(names[i], numbers[i]) for i in range(have, num_lines)]
        for count in _line_token_counts(self.tokenizer, new):
            self.prefix.append(self.prefix[-1] + count)

    def prompt(self, num_lines: int) -> str:
        """Final prompt text with the first ``num_lines`` lines, asking the line at ``depth``."""
        self.extend(num_lines)
        asked = target_index_for_depth(self.depth, num_lines)
        names, numbers = self.stream.names[:num_lines], self.stream.numbers[:num_lines]
        text = build_record_text(names, numbers, asked, self.prompt_style)
        return apply_template(self.tokenizer, text, self.chat_template)

    def tokens(self, num_lines: int) -> int:
        """Token count of :meth:`prompt` (full tokenization, cached)."""
        if num_lines not in self.counts:
            ids = encode_prompt(self.tokenizer, self.prompt(num_lines), self.chat_template)
            self.counts[num_lines] = len(ids)
        return self.counts[num_lines]

    def _guess(self, target_tokens: int, overhead: int, ratio: float) -> int:
        """Largest n >= 1 with ``overhead + ratio * prefix[n] <= target_tokens`` (bisection over the
        prefix sums, generating lines until they pass the target)."""
        most = name_capacity(self.stream.num_words) // 2
        while overhead + ratio * self.prefix[-1] <= target_tokens:
            if len(self.stream) >= most:
                raise _NamesExhausted
            self.extend(min(2 * len(self.stream), most))
        return max(1, bisect.bisect_right(self.prefix, (target_tokens - overhead) / ratio) - 1)

    def fit(self, target_tokens: int) -> int:
        """The line count; ValueError when even one line does not fit."""
        if self.tokens(1) > target_tokens:
            raise RecordTooShortError(target_tokens, self.tokens(1))
        overhead = self.tokens(1) - self.prefix[1]  # header, question, template, BOS
        guess = self._guess(target_tokens, overhead, 1.0)
        # A tokenizer that merges across line boundaries counts lines differently in context than
        # alone: rescale the prefix sums by the in-context/standalone ratio seen at the first guess
        # (exactly 1 for additive tokenizers, where the guess stands).
        ratio = (self.tokens(guess) - overhead) / max(1, self.prefix[guess])
        if ratio != 1.0 and guess > 1:
            guess = self._guess(target_tokens, overhead, ratio)

        def fits(n: int) -> bool:
            return self.tokens(n) <= target_tokens

        return largest_fitting(fits, guess, 1)


@dataclass
class FittedRecord:
    """A record fitted to a token budget: ``prompt`` (final text, chat template applied if asked)
    holds ``len(names)`` lines; the question asks for line ``target_index``; ``num_tokens`` is the
    prompt's token count (see the module docstring for the BOS convention)."""

    prompt: str
    names: list[str]
    numbers: list[int]
    target_index: int
    num_tokens: int

    @property
    def answer(self) -> str:
        """The number stored in the asked line, as text."""
        return str(self.numbers[self.target_index])


def fit_record(
    tokenizer: Any,
    target_tokens: int,
    depth: float,
    seed: int,
    chat_template: bool,
    prompt_style: str = "ringft",
) -> FittedRecord:
    """The record whose prompt has ``num_tokens <= target_tokens`` tokens while one more line
    would exceed it, the asked line at relative ``depth`` (0 = first line, 1 = last), header and
    question from ``prompt_style`` ("ringft" or "longchat"). Deterministic from ``seed``.

    Cost: one batched tokenization of the lines, then two full-prompt tokenizations when the
    tokenizer is additive on line boundaries (a few more, logarithmically, when it is not).
    ValueError when ``target_tokens`` cannot hold even one line, or on a bad depth or style.
    """
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    target_index_for_depth(depth, 1)  # validates depth
    get_prompt_style(prompt_style)  # validates the style name
    # Name width: the narrowest whose name space holds twice the lines that could fit, judged from
    # the shortest of a few 2-word probe lines; widened if the record turns out to need more.
    probe = RecordStream(derive_seed("probe", seed), 2)
    probe.ensure(_PROBE_LINES)
    pairs = zip(probe.names, probe.numbers, strict=True)
    shortest = min(_line_token_counts(tokenizer, [render_line(n, v) for n, v in pairs]))
    num_words = _words_for(target_tokens // max(1, shortest) + 1)
    while True:
        stream = RecordStream(seed, num_words)
        fitter = _RecordFitter(tokenizer, stream, depth, chat_template, prompt_style)
        try:
            n = fitter.fit(target_tokens)
            break
        except _NamesExhausted:
            num_words += 1
    asked = target_index_for_depth(depth, n)
    names, numbers = list(stream.names[:n]), list(stream.numbers[:n])
    return FittedRecord(fitter.prompt(n), names, numbers, asked, fitter.tokens(n))
