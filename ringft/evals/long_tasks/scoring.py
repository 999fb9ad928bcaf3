"""Scoring: RULER's metrics (``scripts/eval/synthetic/constants.py``, ``evaluate.py``), LongLoRA's
passkey exact match, and RULER's effective length.

Per-sample scores are fractions in [0, 1]; a task's score at one length is
:func:`aggregate_score` of them (the mean x 100, rounded to 2 decimals), which is exactly RULER's
``string_match_all(preds, refs)`` / ``string_match_part(preds, refs)`` over the same samples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_THRESHOLD",
    "EffectiveLength",
    "aggregate_score",
    "average_over_tasks",
    "check_threshold",
    "effective_length",
    "format_length",
    "passkey_match",
    "postprocess_prediction",
    "ruler_string_match_all",
    "ruler_string_match_part",
    "string_match_all",
    "string_match_part",
]

#: RULER's threshold: Llama-2-7B's average score at 4K.
DEFAULT_THRESHOLD = 85.6

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, turn control characters into newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references found in the prediction, case-insensitive (RULER, one sample)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    text = prediction.lower()
    return sum(1.0 if r.lower() in text else 0.0 for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any reference is found in the prediction, case-insensitive, else 0 (RULER's QA metric)."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    text = prediction.lower()
    return max(1.0 if r.lower() in text else 0.0 for r in references)


_LEADING_INTEGER = re.compile(r"\s*(\d+)")


def passkey_match(prediction: str, references: Sequence[str]) -> float:
    """LongLoRA's exact match: 1 if the continuation starts (after whitespace) with the key and no
    further digit follows, else 0. LongLoRA generates exactly the key's tokens and compares ids;
    this is the same verdict on any longer greedy continuation."""
    if len(references) != 1:
        raise ValueError(f"passkey_match needs exactly one reference, got {len(references)}")
    match = _LEADING_INTEGER.match(prediction)
    return 1.0 if match is not None and match.group(1) == references[0] else 0.0


def aggregate_score(scores: Iterable[float]) -> float:
    """A task's score: mean of the per-sample fractions x 100, rounded to 2 decimals (RULER)."""
    scores = list(scores)
    if not scores:
        raise ValueError("no samples to aggregate")
    return round(sum(scores) / len(scores) * 100, 2)


def ruler_string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's batch ``string_match_all`` (same value as :func:`aggregate_score` of the per-sample one)."""
    _check_batch(predictions, references)
    return aggregate_score(string_match_all(p, r) for p, r in zip(predictions, references))


def ruler_string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's batch ``string_match_part``."""
    _check_batch(predictions, references)
    return aggregate_score(string_match_part(p, r) for p, r in zip(predictions, references))


def _check_batch(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")


def check_threshold(threshold: float) -> float:
    """``threshold`` as a float if it lies in (0, 100], else a one-line ValueError."""
    value = float(threshold)
    if not (math.isfinite(value) and 0 < value <= 100):
        raise ValueError(f"threshold must be in (0, 100] (a score in percent), got {threshold}")
    return value


def format_length(tokens: int) -> str:
    """RULER's length labels: 4096 -> "4K", 131072 -> "128K", 1048576 -> "1M", 3000 -> "3000"."""
    if tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    if tokens % 1024 == 0:
        return f"{tokens >> 10}K"
    return str(tokens)


@dataclass(frozen=True)
class EffectiveLength:
    """RULER's effective length of one model.

    ``length`` is the longest evaluated length such that it and every shorter evaluated length score
    at least ``threshold``; None when the shortest one already fails. ``all_pass`` is true when every
    evaluated length passes (RULER then writes ">128K": the true effective length is not measured).
    ``passing`` lists every passing length, so a pass beyond a failure stays visible.
    """

    length: int | None
    threshold: float
    all_pass: bool
    passing: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def label(self) -> str:
        """``"<4K"`` / ``"32K"`` / ``">128K"``, as RULER's table writes it."""
        if self.length is None:
            return "<" + format_length(self.lengths[0])
        return (">" if self.all_pass else "") + format_length(self.length)


def effective_length(scores: Mapping[int, float], threshold: float = DEFAULT_THRESHOLD) -> EffectiveLength:
    """RULER's effective length from one model's score at each length (its average over the tasks).

    Definition used: the longest length ``L`` such that every evaluated length ``<= L`` scores at
    least ``threshold``. RULER calls it the length up to which a model exceeds the threshold
    (Llama-2-7B's 85.6 at 4K); in its results table every model's effective length is the end of
    such an unbroken run from 4K, and its Qwen3-32B row counts a score equal to 85.6 as passing, hence
    ``>=``. Lengths must be positive and scores in [0, 100].
    """
    threshold = check_threshold(threshold)
    if not scores:
        raise ValueError("no scores: evaluate at least one length")
    lengths = tuple(sorted(scores))
    for length in lengths:
        score = scores[length]
        if not isinstance(length, int) or length <= 0:
            raise ValueError(f"lengths must be positive integers, got {length!r}")
        if not (math.isfinite(score) and 0 <= score <= 100):
            raise ValueError(f"score at length {length} must be in [0, 100], got {score}")
    passing = tuple(length for length in lengths if scores[length] >= threshold)
    best = None
    for length in lengths:
        if scores[length] < threshold:
            break
        best = length
    return EffectiveLength(best, threshold, len(passing) == len(lengths), passing, lengths)


def average_over_tasks(table: Mapping[str, Mapping[int, float]]) -> dict[int, float]:
    """Per-length average of per-task scores (RULER's "Avg." row); every task must have every length."""
    if not table:
        raise ValueError("no tasks in the score table")
    lengths = None
    for task, row in table.items():
        if lengths is None:
            lengths = set(row)
        elif set(row) != lengths:
            raise ValueError(f"task {task} was scored at lengths {sorted(row)}, others at {sorted(lengths)}")
    return {length: sum(row[length] for row in table.values()) / len(table) for length in sorted(lengths)}
