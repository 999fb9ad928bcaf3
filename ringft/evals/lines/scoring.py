"""Scoring of line-retrieval answers: which integer of the generated text counts as the answer.

Two rules (``--scoring``):

- ``longchat`` (LongChat's published rule): the *last* match of the regular expression ``\\d+`` in
  the output, as an integer. Python's ``\\d`` also matches non-ASCII decimal digits, as in LongChat.
- ``first-int``: the first integer, read with the rules of :func:`extract_first_integer`.

On a model's sentence answers ("The <REGISTER_CONTENT> of line brave-otter is 20854.") the two
agree: record names contain no digits, so the stored number is the only integer of the sentence.
They differ on answers that hold several numbers ("12 or 123") or grouped digits ("20,854").
"""

from __future__ import annotations

import re

# A comma-grouped number ("12,345", "1,234,567": groups of exactly three digits) or a plain
# run of ASCII digits. Digits are found anywhere, also glued to letters ("line42" -> 42).
_INT_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+")
# LongChat's own pattern (longeval/utils.py: re.findall("\d+", output)[-1]).
_LONGCHAT_RE = re.compile(r"\d+")

SCORING_RULES = ("longchat", "first-int")


def extract_first_integer(text: str) -> int | None:
    """First integer in ``text``, or ``None`` if it has no ASCII digit.

    Rules: leading zeros are dropped ("00123" -> 123); a minus sign is ignored ("-7" -> 7;
    the stored numbers are always positive and line names contain hyphens); comma thousand
    separators in proper groups of three are joined ("12,345" -> 12345, but "12,34" -> 12);
    a decimal point ends the number ("12.5" -> 12); digits inside words count ("line42"
    -> 42); non-ASCII digits are not recognised.
    """
    m = _INT_RE.search(text)
    if m is None:
        return None
    return int(m.group(0).replace(",", ""))


def extract_last_integer(text: str) -> int | None:
    """LongChat's rule: the last run of decimal digits (``\\d+``) in ``text`` as an integer, or
    ``None`` when there is none ("12 or 123" -> 123, "20,854" -> 854, "00123" -> 123)."""
    found = _LONGCHAT_RE.findall(text)
    return int(found[-1]) if found else None


def extract_answer(text: str, scoring: str) -> int | None:
    """The integer that ``scoring`` ("longchat" or "first-int") reads from ``text``, or ``None``."""
    if scoring == "longchat":
        return extract_last_integer(text)
    if scoring == "first-int":
        return extract_first_integer(text)
    raise ValueError(f"scoring {scoring!r} is not one of {list(SCORING_RULES)}")


def score_answer(generated_text: str, answer: str | int, scoring: str = "first-int") -> bool:
    """True iff the integer that ``scoring`` reads from ``generated_text`` equals ``answer``."""
    got = extract_answer(generated_text, scoring)
    return got is not None and got == int(answer)
