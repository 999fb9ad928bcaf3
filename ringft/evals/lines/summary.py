"""Summaries of line-retrieval results: accuracy and mean answer probability per length x depth.

Rows are the requested prompt length in tokens (generated cases) or ``<N> lines`` (cases read from
a LongChat test-case file, whose asked line sits at a random depth: one "all" column). Writes
``summary.csv``, ``summary.md`` and ``heatmap.png`` (accuracy).
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ALL = "all"


def _row_of(record: dict[str, Any]) -> tuple[int, int, str]:
    """Sort key and label of a record's row: (source order, size, label)."""
    if record.get("source", "ringft") == "longchat":
        return (1, record["num_lines"], f"{record['num_lines']} lines")
    return (0, record["length"], str(record["length"]))


def _column_of(record: dict[str, Any]) -> float | str:
    return ALL if record.get("source", "ringft") == "longchat" else float(record["depth"])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt(value: float) -> str:
    """An accuracy: two decimals."""
    return "-" if math.isnan(value) else f"{value:.2f}"


def _fmt_prob(value: float) -> str:
    """A probability: two decimals from 0.01 up, else two significant digits (``3.7e-05``), so that
    a model far from the answer still shows how far."""
    if math.isnan(value):
        return "-"
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.1e}"


def _table(title: str, rows, columns, cells, rows_all, metric, fmt=_fmt) -> list[str]:
    """Markdown lines of one metric's rows x columns table with an ``all`` column."""
    heads = [c if c == ALL else f"{c:.0%}" for c in columns]
    out = [title, "", "| tokens \\ depth | " + " | ".join(heads) + " | all | mean tokens |"]
    out.append("|" + "---|" * (len(columns) + 3))
    for row in rows:
        values = [metric(cells.get((row, c), [])) for c in columns]
        everyone = rows_all[row]
        tokens = _mean([r["num_tokens"] for r in everyone])
        line = " | ".join(fmt(v) for v in values)
        out.append(f"| {row[2]} | {line} | {fmt(metric(everyone))} | {tokens:.0f} |")
    return out


def summarize(results: list[dict[str, Any]], out_dir: Path, scoring: str, max_new_tokens: int) -> str:
    """Write ``summary.csv``, ``summary.md`` and ``heatmap.png`` into ``out_dir``; return the
    Markdown text. ``results``: one record per case with ``correct`` (under ``scoring``),
    ``answer_prob``, ``teacher_forced_correct``, ``num_tokens``, ``length``, ``depth``."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    rows_all: dict[tuple, list[dict]] = defaultdict(list)
    for record in results:
        row = _row_of(record)
        cells[(row, _column_of(record))].append(record)
        rows_all[row].append(record)
    rows = sorted(rows_all)
    depths = sorted({c for _, c in cells if c != ALL})
    columns: list = depths + ([ALL] if any(c == ALL for _, c in cells) else [])

    def accuracy(rs):
        return _mean([float(r["correct"]) for r in rs])

    def answer_prob(rs):
        return _mean([r["answer_prob"] for r in rs])

    with open(out_dir / "summary.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "length",
                "depth",
                "cases",
                "mean_tokens",
                "accuracy",
                "mean_answer_prob",
                "teacher_forced_accuracy",
            ]
        )
        for (row, column), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            writer.writerow(
                [
                    row[2],
                    column,
                    len(rs),
                    f"{_mean([r['num_tokens'] for r in rs]):.1f}",
                    f"{accuracy(rs):.4f}",
                    f"{answer_prob(rs):.4g}",
                    f"{_mean([float(r['teacher_forced_correct']) for r in rs]):.4f}",
                ]
            )
    rule = {
        "longchat": "the last integer of the output must equal the stored number (LongChat's rule)",
        "first-int": "the first integer of the output must equal the stored number",
    }[scoring]
    lines = _table(
        f"Accuracy: greedy generation (at most {max_new_tokens} new tokens, stops at EOS); {rule}.",
        rows,
        columns,
        cells,
        rows_all,
        accuracy,
    )
    lines += [""] + _table(
        "Mean answer probability: teacher-forced p(the stored number as the reply | prompt).",
        rows,
        columns,
        cells,
        rows_all,
        answer_prob,
        _fmt_prob,
    )
    lines.append(
        f"\nOverall accuracy: {accuracy(results):.3f} over {len(results)} cases; "
        f"mean answer probability {_fmt_prob(answer_prob(results))}."
    )
    table = "\n".join(lines)
    (out_dir / "summary.md").write_text(table + "\n")
    _heatmap(out_dir / "heatmap.png", rows, columns, cells, accuracy)
    return table


def _heatmap(path: Path, rows, columns, cells, accuracy) -> None:
    """Accuracy heatmap: rows = prompt length, columns = depth of the asked line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[accuracy(cells.get((row, c), [])) for c in columns] for row in rows]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(columns), 1.0 + 0.6 * len(rows)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(columns)), [c if c == ALL else f"{c:.0%}" for c in columns])
    ax.set_yticks(range(len(rows)), [row[2] for row in rows])
    ax.set_xlabel("depth of the asked line")
    ax.set_ylabel("prompt tokens")
    ax.set_title("line retrieval accuracy")
    for i, values in enumerate(grid):
        for j, value in enumerate(values):
            ax.text(j, i, _fmt(value), ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
