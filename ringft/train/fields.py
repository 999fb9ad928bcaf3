"""Typed recipe fields: each declares its type and range, checked when the recipe is built.

A section is a dataclass deriving from :class:`Section` whose fields are declared with the helpers
below (``integer(1, lo=1)``, ``number(2e-5, gt=0)``, ``choice("constant", ("constant", "cosine"))``,
...). ``Section.__post_init__`` checks every field (with :mod:`ringft.utils.values`, the one validator)
and raises :class:`RecipeError` with one line that names the key, the value and what would be
accepted, e.g.
``train.max_steps must be an integer >= 1, got '20' (a string: write 20 without quotes)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar

from ringft.train.errors import RecipeError
from ringft.utils import values

__all__ = ["Section", "boolean", "choice", "integer", "number", "pair", "text", "text_list"]

Check = Callable[[str, Any], Any]


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
    return _field(default, partial(_integer, lo=lo, hi=hi, optional=optional), doc)


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
    return _field(default, partial(_number, lo=lo, hi=hi, gt=gt, lt=lt, optional=optional), doc)


def boolean(default: bool | None, optional: bool = False, doc: str = "") -> Any:
    """``true`` or ``false`` (not 0/1, not a string); None allowed if ``optional``."""
    return _field(default, partial(_optional_bool, optional=optional), doc)


def choice(default: Any, options: Sequence[Any], doc: str = "") -> Any:
    """One of ``options`` (None allowed only when it is one of them)."""
    return _field(default, partial(_choice, options=options), doc)


def text(default: str | None, optional: bool = False, nonempty: bool = True, doc: str = "") -> Any:
    """A string (a path, a name); None allowed if ``optional``."""
    return _field(default, partial(_text, optional=optional, nonempty=nonempty), doc)


def text_list(default: list[str], doc: str = "") -> Any:
    """A non-empty list of non-empty strings."""
    return _field(default, _names, doc)


def pair(default: tuple[float, float], lo: float, lt: float, doc: str = "") -> Any:
    """Two numbers, each in ``[lo, lt)`` (e.g. Adam's betas)."""
    return _field(default, partial(_pair, lo=lo, lt=lt), doc)


# The checks themselves are ringft.utils.values', raising RecipeError.
_integer = partial(values.as_integer, error=RecipeError)
_number = partial(values.as_number, error=RecipeError)
_bool = partial(values.as_bool, error=RecipeError)
_choice = partial(values.as_choice, error=RecipeError)
_text = partial(values.as_text, error=RecipeError)
_names = partial(values.as_names, error=RecipeError)
_pair = partial(values.as_pair, error=RecipeError)


def _optional_bool(where: str, value: Any, optional: bool) -> bool | None:
    return None if value is None and optional else _bool(where, value)


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
