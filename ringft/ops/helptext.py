"""Plain text for ``--help`` from the reST of docstrings: one helper for every command's help.

``plain`` turns ````x```` into ``x``, ``:func:`x``` / ``:mod:`a.b``` / ``:class:`~a.b.C``` into ``x`` /
``a.b`` / ``C``, single-backquoted ``x`` into ``x`` and a paragraph ending ``::`` into ``:``.
"""

from __future__ import annotations

import re

__all__ = ["plain"]

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_TITLE = re.compile(r"`([^`]+)`")


def _role(match: re.Match) -> str:
    text = match.group(1)
    return text.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else text


def plain(text: str | None) -> str:
    """``text`` (reST) as plain text for a terminal; None -> ``""``."""
    if not text:
        return ""
    text = _ROLE.sub(_role, text)
    text = _LITERAL.sub(r"\1", text)
    text = _TITLE.sub(r"\1", text)
    return re.sub(r"::(\s*\n)", r":\1", text).strip()
