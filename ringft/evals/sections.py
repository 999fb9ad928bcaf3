"""The building blocks of a report section (``ringft eval-report``): each task's ``report`` module
turns its runs' ``summary.json`` into blocks, and :mod:`ringft.evals.report.page` renders them as
Markdown or HTML.

A block is ``("text", str)``, ``("table", (header, rows))`` or ``("images", [(caption, path)])``; a
run is ``(label, summary)``, the summary holding the run's ``folder``.
"""

from __future__ import annotations

from typing import Any

Block = tuple[str, Any]
Run = tuple[str, dict]


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: ``-`` for None, floats with ``digits`` decimals."""
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def by_length(runs: list[Run], field: str, digits: int) -> tuple[list[str], list[list[str]]]:
    """Rows = lengths, one column per (run, series) of ``run[field]`` = ``{series: {L: value}}``."""
    columns = [(label, name, series) for label, run in runs for name, series in run[field].items()]
    lengths = sorted({int(n) for _, _, series in columns for n in series})
    header = ["L"] + [f"{label}: {name}" for label, name, _ in columns]
    rows = [[str(n)] + [fmt(series.get(str(n)), digits) for _, _, series in columns] for n in lengths]
    return header, rows


def images(runs: list[Run]) -> Block:
    """Every run's figures, captioned with its label."""
    return "images", [(label, run["folder"] / f) for label, run in runs for f in run.get("figures", [])]
