"""eval-ruler's section of ``ringft eval-report``: the model x length table with effective lengths."""

from __future__ import annotations

from pathlib import Path

from ringft.evals.sections import Block, Run, fmt, images

TITLE = "RULER"


def section(runs: list[Run], out: Path) -> list[Block]:
    """The average over the tasks per run and length with the effective length, then per task."""
    lengths = sorted({int(n) for _, run in runs for n in run["average"]})
    header = ["model"] + [str(n) for n in lengths] + ["effective length"]
    rows = [
        [label]
        + [fmt(run["average"].get(str(n)), 1) for n in lengths]
        + [f"{run['effective_length']} (threshold {run['threshold']:g})"]
        for label, run in runs
    ]
    tasks = sorted({t for _, run in runs for t in run["scores"]})
    per_task = ["task"] + [f"{label} @ {n}" for label, _ in runs for n in lengths]
    task_rows = [
        [t] + [fmt(run["scores"].get(t, {}).get(str(n)), 1) for _, run in runs for n in lengths]
        for t in tasks
    ]
    return [
        ("text", "Average over the tasks; per-task scores below."),
        ("table", (header, rows)),
        ("table", (per_task, task_rows)),
        images(runs),
    ]
