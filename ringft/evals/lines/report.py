"""eval-lines' section of ``ringft eval-report``: line-retrieval accuracy by length."""

from __future__ import annotations

from pathlib import Path

from ringft.evals.sections import Block, Run, by_length, images

TITLE = "Line retrieval (LongChat)"


def section(runs: list[Run], out: Path) -> list[Block]:
    """Rows = lengths, one accuracy column per run, then each run's figures."""
    accuracy = [(label, {"accuracy": {"accuracy": run["accuracy"]}}) for label, run in runs]
    return [("table", by_length(accuracy, "accuracy", 2)), images(runs)]
