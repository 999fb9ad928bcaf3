"""Scoring of line-retrieval answers."""

from __future__ import annotations

import re

# A comma-grouped number ("12,345", "1,234,567": groups of exactly three digits) or a plain
# run of ASCII digits. Digits are found anywhere, also glued to letters ("line42" -> 42).
_INT_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+")


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


def score_answer(generated_text: str, answer: str | int) -> bool:
    """True iff the first integer of ``generated_text`` equals ``answer`` as an integer."""
    got = extract_first_integer(generated_text)
    return got is not None and got == int(answer)
