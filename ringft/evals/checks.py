"""Checks of ``eval-lines`` inputs that run before any model loads, on every rank: one line naming
the value and the fix for each bad input, and a warning (with the figures) for lengths past the
model's trained positions."""

from __future__ import annotations

from typing import Any

from ringft.model.rope import has_rope_scaling
from ringft.utils.values import BadValue, as_integer, bad_value, parse_tokens


class EvalInputError(BadValue):
    """A bad ``eval-lines`` input; the message names the value and the fix (exit code 2)."""

    exit_code = 2


def _flag_error(flag: str, text: str, fix: str) -> EvalInputError:
    return EvalInputError(bad_value(flag, text, "", fix))


def parse_lengths(text: str) -> list[int]:
    """Comma-separated prompt lengths in tokens (``k`` = x1024, ``M`` = x1024**2), each positive, no
    repeats."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise _flag_error("--lengths", text, "give at least one prompt length in tokens, e.g. 4096,8k")
    lengths = []
    for item in items:
        try:
            length = parse_tokens(item)
        except ValueError:
            raise _flag_error(
                "--lengths", text, f"{item.strip()!r} is not a whole number of tokens (e.g. 4096, 8k, 1M)"
            ) from None
        if length < 1:
            raise _flag_error("--lengths", text, f"{length} is not a positive number of tokens")
        if length in lengths:
            raise _flag_error("--lengths", text, f"{length} is given twice")
        lengths.append(length)
    return lengths


def parse_depths(text: str, meaning: str = "0 = first line, 1 = last line") -> list[float]:
    """Comma-separated relative depths of the asked line (or, with its ``meaning``, of a needle),
    each in [0, 1], no repeats."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise _flag_error("--depths", text, "give at least one depth in [0, 1], e.g. 0,0.5,1")
    depths = []
    for item in items:
        try:
            depth = float(item)
        except ValueError:
            raise _flag_error("--depths", text, f"{item.strip()!r} is not a number") from None
        if not 0.0 <= depth <= 1.0:  # also refuses nan
            raise _flag_error("--depths", text, f"{item.strip()} is outside [0, 1] ({meaning})")
        if depth in depths:
            raise _flag_error("--depths", text, f"{depth:g} is given twice")
        depths.append(depth)
    return depths


def check_positive(flag: str, value: int, what: str) -> None:
    """Refuse a count below 1: ``--cases 0``, ``--max-new-tokens 0``."""
    as_integer(flag, value, 1, fix=f"give at least 1 {what}", error=EvalInputError)


def check_vocabulary(tokenizer: Any, config: Any, flag: str = "--model") -> None:
    """Refuse a tokenizer whose ids can reach past the embedding rows of the model of ``flag``."""
    size, rows = len(tokenizer), getattr(config, "vocab_size", None)
    if rows is not None and size > rows:
        whose = "the model's" if flag == "--model" else f"the {flag} model's"
        raise EvalInputError(
            f"the tokenizer has {size} tokens but {whose} embedding has {rows} rows (ids >= "
            f"{rows} would read past it): use the model's own tokenizer (--tokenizer)"
        )


def position_warning(config: Any, longest_prompt: int, max_new_tokens: int) -> str | None:
    """A warning when prompt + generation runs past ``max_position_embeddings`` without RoPE
    scaling (accuracy there measures extrapolation), else None."""
    limit = getattr(config, "max_position_embeddings", None)
    longest = longest_prompt + max_new_tokens
    if limit is None or longest <= limit or has_rope_scaling(config):
        return None
    return (
        f"the longest prompt ({longest_prompt} tokens) plus {max_new_tokens} new tokens reaches "
        f"position {longest}, past the model's max_position_embeddings {limit} and it has no RoPE "
        f"scaling: results beyond {limit} tokens measure extrapolation"
    )


def too_short_error(exc: Any) -> EvalInputError:
    """The ``--lengths`` message for a :class:`ringft.data.line_retrieval.RecordTooShortError`."""
    return EvalInputError(
        f"--lengths {exc.target_tokens}: {exc}; use lengths of at least {exc.shortest} tokens"
    )
