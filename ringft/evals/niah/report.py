"""eval-niah's section of ``ringft eval-report``: the score per task and length, over the depths."""

from __future__ import annotations

from pathlib import Path

from ringft.evals.sections import Block, Run, fmt, images

TITLE = "Needle in a haystack (passkey, niah_single_1)"


def section(runs: list[Run], out: Path) -> list[Block]:
    """One row per (task, length), one column per run: the samples' mean score over the depths."""
    tasks = sorted({c["task"] for _, run in runs for c in run["cells"]})
    lengths = sorted({c["length"] for _, run in runs for c in run["cells"]})
    header = ["task", "L"] + [label for label, _ in runs]
    rows = []
    for task in tasks:
        for n in lengths:
            row = [task, str(n)]
            for _, run in runs:
                cells = [c for c in run["cells"] if c["task"] == task and c["length"] == n]
                weight = sum(c["samples"] for c in cells)
                row.append(fmt(sum(c["score"] * c["samples"] for c in cells) / weight, 1) if weight else "-")
            rows.append(row)
    return [
        ("text", "Score (% correct, greedy generation), averaged over the depths:"),
        ("table", (header, rows)),
        images(runs),
    ]
