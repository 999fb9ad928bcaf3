"""Typed recipe fields: each declares its type and range, checked when the recipe is built.

A section is a dataclass deriving from :class:`Section` whose fields are declared with the helpers
below (``integer(1, lo=1)``, ``number(2e-5, gt=0)``, ``choice("constant", ("constant", "cosine"))``,
...). ``Section.__post_init__`` checks every field and raises :class:`RecipeError` with one line that
names the key, the value and what would be accepted, e.g.
``train.max_steps must be an integer >= 1, got '20' (a string: write 20 without quotes)``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ringft.train.errors import RecipeError

__all__ = ["Section", "boolean", "choice", "integer", "number", "pair", "text", "text_list"]

Check = Callable[[str, Any], Any]
# YAML 1.1 (PyYAML) reads "2e-5" (no dot) as a string: accept that form for numbers.
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _got(value: Any) -> str:
    if isinstance(value, str):
        hint = ""
        if re.fullmatch(r"[-+]?\d+", value.strip()):
            hint = f": write {value.strip()} without quotes"
        elif re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", value.strip()):
            hint = f": write {value.strip()} without quotes"
        return f"got {value!r} (a string{hint})"
    return f"got {value!r}"


def _bounds(lo: float | None, hi: float | None, gt: float | None, lt: float | None) -> str:
    parts = []
    if gt is not None:
        parts.append(f"> {gt:g}")
    if lo is not None:
        parts.append(f">= {lo:g}")
    if lt is not None:
        parts.append(f"< {lt:g}")
    if hi is not None:
        parts.append(f"<= {hi:g}")
    return (" " + " and ".join(parts)) if parts else ""


def _in_range(v: float, lo, hi, gt, lt) -> bool:
    return not (
        (lo is not None and v < lo)
        or (hi is not None and v > hi)
        or (gt is not None and v <= gt)
        or (lt is not None and v >= lt)
    )


def _field(default: Any, check: Check, doc: str) -> Any:
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"check": check, "doc": doc}
        )
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc})


def integer(
    default: int | None, lo: int | None = None, hi: int | None = None, optional: bool = False, doc: str = ""
) -> Any:
    """A whole number (never a bool, a float or a string) in ``[lo, hi]``; None allowed if ``optional``."""

    def check(where: str, value: Any) -> int | None:
        if value is None and optional:
            return None
        kind = "an integer" + (" or null" if optional else "")
        if isinstance(value, bool) or not isinstance(value, int):
            hint = " (write a whole number, without a decimal point)" if isinstance(value, float) else ""
            raise RecipeError(f"{where} must be {kind}{_bounds(lo, hi, None, None)}, {_got(value)}{hint}")
        if not _in_range(value, lo, hi, None, None):
            raise RecipeError(f"{where} must be {kind}{_bounds(lo, hi, None, None)}, got {value}")
        return value

    return _field(default, check, doc)


def _as_number(where: str, value: Any, kind: str) -> float:
    if isinstance(value, str) and _SCIENTIFIC.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecipeError(f"{where} must be {kind}, {_got(value)}")
    if not math.isfinite(value):
        raise RecipeError(f"{where} must be {kind}, got {value!r} (not a finite number)")
    return float(value)


def number(
    default: float | None,
    lo: float | None = None,
    hi: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    optional: bool = False,
    doc: str = "",
) -> Any:
    """A finite real number (int or float; ``2e-5`` as YAML 1.1 reads it, a string, is accepted)."""

    def check(where: str, value: Any) -> float | None:
        if value is None and optional:
            return None
        kind = "a number" + _bounds(lo, hi, gt, lt) + (" or null" if optional else "")
        v = _as_number(where, value, kind)
        if not _in_range(v, lo, hi, gt, lt):
            raise RecipeError(f"{where} must be {kind}, got {value!r}")
        return v

    return _field(default, check, doc)


def boolean(default: bool, doc: str = "") -> Any:
    """``true`` or ``false`` (not 0/1, not a string)."""

    def check(where: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{where} must be true or false, {_got(value)}")
        return value

    return _field(default, check, doc)


def choice(default: Any, options: Sequence[Any], doc: str = "") -> Any:
    """One of ``options`` (None allowed only when it is one of them)."""

    def check(where: str, value: Any) -> Any:
        if value not in options or isinstance(value, bool) != any(isinstance(o, bool) for o in options):
            shown = ", ".join("null" if o is None else str(o) for o in options)
            raise RecipeError(f"{where} must be one of {shown}, got {value!r}")
        return value

    return _field(default, check, doc)


def text(default: str | None, optional: bool = False, nonempty: bool = True, doc: str = "") -> Any:
    """A string (a path, a name); None allowed if ``optional``."""

    def check(where: str, value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or (nonempty and not value.strip()):
            kind = "a non-empty string" if nonempty else "a string"
            raise RecipeError(f"{where} must be {kind}{' or null' if optional else ''}, got {value!r}")
        return value

    return _field(default, check, doc)


def text_list(default: list[str], doc: str = "") -> Any:
    """A non-empty list of non-empty strings."""

    def check(where: str, value: Any) -> list[str]:
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            raise RecipeError(f"{where} must be a non-empty list of names, got {value!r}")
        return list(value)

    return _field(default, check, doc)


def pair(default: tuple[float, float], lo: float, lt: float, doc: str = "") -> Any:
    """Two numbers, each in ``[lo, lt)`` (e.g. Adam's betas)."""

    def check(where: str, value: Any) -> tuple[float, float]:
        kind = f"two numbers in [{lo:g}, {lt:g})"
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise RecipeError(f"{where} must be {kind}, e.g. [0.9, 0.95], got {value!r}")
        out = tuple(_as_number(where, v, kind) for v in value)
        if not all(lo <= v < lt for v in out):
            raise RecipeError(f"{where} must be {kind}, got {list(value)!r}")
        return out  # type: ignore[return-value]

    return _field(default, check, doc)


class Section:
    """Base of the recipe's sections: checks every declared field, then :meth:`check`."""

    NAME: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check = f.metadata.get("check")
            if check is not None:
                setattr(self, f.name, check(f"{self.NAME}.{f.name}", getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Checks that involve several fields of the section (none by default)."""
