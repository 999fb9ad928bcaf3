"""Typed value checks with one error style: every user-facing setting is read through these.

Each ``as_*`` function returns the value as its type (an int, a float, ...) or raises ``error``
(default :class:`BadValue`, a ``ValueError``; callers pass their own subclass, e.g. the recipe's
``RecipeError``) with one line that names where the value comes from, the value as given, what is
accepted and, when the caller knows it, the fix:

- a recipe or config key: ``train.lr must be a number > 0, got 'fast'``
  (``got '20' (a string: write 20 without quotes)`` for a quoted number);
- a command-line flag, as typed: ``--cases 0: give at least 1 case`` (``must be ...`` without a fix).

:func:`problems` collects the messages of several checks instead of raising the first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "BadValue",
    "as_bool",
    "as_choice",
    "as_integer",
    "as_names",
    "as_number",
    "as_pair",
    "as_text",
    "bad_value",
    "parse_tokens",
    "problems",
    "tokens_arg",
]

# Token counts on a command line: 4096, 128k / 128K (x 1024), 1M (x 1024**2); a sign is kept so that
# the flag's own range check names a negative value.
_TOKENS = re.compile(r"^([-+]?\d+)([kKmM]?)$")
_TOKEN_SCALE = {"": 1, "k": 1024, "m": 1024**2}

# YAML 1.1 (PyYAML) reads "2e-5" (no dot) as a string: accept that form for numbers.
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class BadValue(ValueError):
    """A setting with a value that is not accepted; the message is one line (see the module)."""


def _got(value: Any, typed: bool) -> str:
    """``got <value>``; for a typed setting, a string says so (and how to write a quoted number)."""
    if typed and isinstance(value, str):
        number = re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", value.strip())
        return f"got {value!r} (a string{f': write {value.strip()} without quotes' if number else ''})"
    return f"got {value!r}"


def bad_value(where: str, value: Any, accepted: str, fix: str | None = None, typed: bool = True) -> str:
    """The one error style (see the module docstring): a flag (``--x``) is quoted as typed, a key
    as ``<key> must be <accepted>, got <value>``; ``typed``: ``accepted`` is a type (a number, ...),
    so a string value is pointed out as one."""
    if where.startswith("--"):
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        if isinstance(value, str) and (value != value.strip() or not value.strip(" ,")):
            shown = repr(value)  # nothing but blanks / commas: quote it
        return f"{where} {shown}: {fix or 'must be ' + accepted}"
    return f"{where} must be {accepted}, {_got(value, typed)}" + (f": {fix}" if fix else "")


def _bounds(lo: float | None, hi: float | None, gt: float | None, lt: float | None) -> str:
    parts = [f"{op} {v:g}" for op, v in ((">", gt), (">=", lo), ("<", lt), ("<=", hi)) if v is not None]
    return (" " + " and ".join(parts)) if parts else ""


def _in_range(v: float, lo, hi, gt, lt) -> bool:
    return not (
        (lo is not None and v < lo)
        or (hi is not None and v > hi)
        or (gt is not None and v <= gt)
        or (lt is not None and v >= lt)
    )


def as_integer(
    where: str,
    value: Any,
    lo: int | None = None,
    hi: int | None = None,
    *,
    optional: bool = False,
    fix: str | None = None,
    error: type[ValueError] = BadValue,
) -> int | None:
    """A whole number (never a bool, a float or a string) in ``[lo, hi]``; None if ``optional``."""
    if value is None and optional:
        return None
    kind = "an integer" + _bounds(lo, hi, None, None) + (" or null" if optional else "")
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (write a whole number, without a decimal point)" if isinstance(value, float) else ""
        raise error(bad_value(where, value, kind, fix) + hint)
    if not _in_range(value, lo, hi, None, None):
        raise error(bad_value(where, value, kind, fix))
    return value


def as_number(
    where: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    gt: float | None = None,
    lt: float | None = None,
    optional: bool = False,
    fix: str | None = None,
    error: type[ValueError] = BadValue,
) -> float | None:
    """A finite real number in the bounds (an int or a float; ``"2e-5"`` as YAML 1.1 reads it)."""
    if value is None and optional:
        return None
    kind = "a number" + _bounds(lo, hi, gt, lt) + (" or null" if optional else "")
    number = float(value) if isinstance(value, str) and _SCIENTIFIC.match(value.strip()) else value
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise error(bad_value(where, value, kind, fix))
    if not math.isfinite(number):
        raise error(bad_value(where, value, kind, fix or "not a finite number"))
    if not _in_range(number, lo, hi, gt, lt):
        raise error(bad_value(where, value, kind, fix))
    return float(number)


def as_bool(where: str, value: Any, *, error: type[ValueError] = BadValue) -> bool:
    """``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise error(bad_value(where, value, "true or false"))
    return value


def as_choice(
    where: str,
    value: Any,
    options: Sequence[Any],
    *,
    fix: str | None = None,
    error: type[ValueError] = BadValue,
) -> Any:
    """One of ``options`` (None only when it is one of them; a bool only among bools)."""
    if value not in options or isinstance(value, bool) != any(isinstance(o, bool) for o in options):
        shown = ", ".join("null" if o is None else str(o) for o in options)
        raise error(bad_value(where, value, f"one of {shown}", fix, typed=False))
    return value


def as_text(
    where: str,
    value: Any,
    *,
    optional: bool = False,
    nonempty: bool = True,
    error: type[ValueError] = BadValue,
) -> str | None:
    """A string (a path, a name); None if ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or (nonempty and not value.strip()):
        kind = ("a non-empty string" if nonempty else "a string") + (" or null" if optional else "")
        raise error(bad_value(where, value, kind, typed=False))
    return value


def as_names(
    where: str, value: Any, *, fix: str | None = None, error: type[ValueError] = BadValue
) -> list[str]:
    """A non-empty list of non-empty strings (module names, ...)."""
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, str) and v.strip() for v in value)
    ):
        raise error(bad_value(where, value, "a non-empty list of names", fix, typed=False))
    return list(value)


def as_pair(
    where: str, value: Any, lo: float, lt: float, *, error: type[ValueError] = BadValue
) -> tuple[float, float]:
    """Two numbers, each in ``[lo, lt)`` (e.g. Adam's betas)."""
    kind = f"two numbers in [{lo:g}, {lt:g})"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise error(bad_value(where, value, kind, "e.g. [0.9, 0.95]", typed=False))
    out = tuple(as_number(where, v, error=error) for v in value)
    if not all(lo <= v < lt for v in out):
        raise error(bad_value(where, list(value), kind, typed=False))
    return out  # type: ignore[return-value]


def problems(*checks: Callable[[], Any]) -> list[str]:
    """The message of every check (a no-argument call of an ``as_*`` function) that fails."""
    found = []
    for check in checks:
        try:
            check()
        except BadValue as exc:
            found.append(str(exc))
    return found


def parse_tokens(text: str | int) -> int:
    """A token count as written on a command line: ``"4096"`` -> 4096, ``"128k"`` / ``"128K"`` ->
    131072, ``"1M"`` -> 1048576 (k = 1024). ValueError (one line, e.g. ``4.5k``) on anything else.
    Every length flag of every command reads its value through this function."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _TOKENS.match(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a whole number of tokens (e.g. 65536, 64k, 1M; k = 1024)")
    return int(match.group(1)) * _TOKEN_SCALE[match.group(2).lower()]


def tokens_arg(text: str) -> int:
    """:func:`parse_tokens` as an ``argparse`` ``type=`` (its one-line error as argparse's)."""
    import argparse

    try:
        return parse_tokens(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
