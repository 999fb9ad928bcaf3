"""Compare ``ringft eval-lines`` runs: a before/after table by length and one side-by-side figure.

Each run is read from its ``summary.csv`` by column name (``length``, ``depth``, ``accuracy``, and
``cases`` when present; other columns are ignored), so the comparison keeps working when the eval
adds columns. Used by ``recipes/demo_cpu.sh``::

    python -m ringft.evals.lines.compare outputs/demo/eval-before outputs/demo/eval-after \\
        --labels "base model" "extended" --figure outputs/demo/before_after.png
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

REQUIRED_COLUMNS = ("length", "depth", "accuracy")


@dataclass(frozen=True)
class Cell:
    """One (length, depth) cell of an eval: its accuracy in [0, 1] over ``cases`` cases."""

    cases: int
    accuracy: float


#: One run's cells keyed by (prompt length in tokens, depth of the asked line in [0, 1]).
Summary = dict[tuple[int, float], Cell]


def summary_path(run: str | Path) -> Path:
    """``run`` itself when it is a file, else ``run/summary.csv`` (an eval-lines ``--output``)."""
    path = Path(run)
    return path if path.is_file() else path / "summary.csv"


def read_summary(run: str | Path) -> Summary:
    """The cells of one eval run (a ``summary.csv`` or the folder holding it).

    Raises ValueError naming the file when it is missing, lacks a required column or is empty.
    """
    path = summary_path(run)
    if not path.is_file():
        raise ValueError(f"no eval summary at {path}: pass an eval-lines --output folder or its summary.csv")
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} has no column(s) {', '.join(missing)} (columns: {reader.fieldnames})")
        cells: Summary = {}
        for row in reader:
            cases = int(row["cases"]) if row.get("cases") not in (None, "") else 1
            cells[(int(row["length"]), float(row["depth"]))] = Cell(cases, float(row["accuracy"]))
    if not cells:
        raise ValueError(f"{path} has no rows")
    return cells


def accuracy_by_length(cells: Summary) -> dict[int, tuple[float, int]]:
    """Per prompt length: (case-weighted accuracy over all depths, number of cases)."""
    out: dict[int, tuple[float, int]] = {}
    for length in sorted({k[0] for k in cells}):
        row = [c for (n, _), c in cells.items() if n == length]
        total = sum(c.cases for c in row)
        out[length] = (sum(c.accuracy * c.cases for c in row) / total, total)
    return out


def comparison_table(runs: list[tuple[str, Summary]]) -> str:
    """Markdown table: one row per prompt length, one accuracy column per run (all depths pooled),
    and the cases behind each figure."""
    per_run = [accuracy_by_length(cells) for _, cells in runs]
    lengths = sorted({n for acc in per_run for n in acc})
    header = "| prompt tokens | " + " | ".join(name for name, _ in runs) + " | cases per run |"
    lines = [header, "|---:|" + "---:|" * len(runs) + "---:|"]
    for length in lengths:
        accs = [acc.get(length) for acc in per_run]
        cells = [f"{a[0]:.2f}" if a else "-" for a in accs]
        counts = [str(a[1]) if a else "-" for a in accs]
        shown = counts[0] if len(set(counts)) == 1 else "/".join(counts)  # per run when they differ
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {shown} |")
    return "\n".join(lines)


def _grid(cells: Summary, lengths: list[int], depths: list[float]) -> list[list[float]]:
    return [[cells[(n, d)].accuracy if (n, d) in cells else math.nan for d in depths] for n in lengths]


def plot_comparison(runs: list[tuple[str, Summary]], path: str | Path, title: str | None = None) -> Path:
    """One figure with the runs' accuracy heatmaps side by side (prompt length x depth, shared
    axes and colour scale 0..1, each cell annotated); written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({k[0] for _, cells in runs for k in cells})
    depths = sorted({k[1] for _, cells in runs for k in cells})
    width = 1.0 + len(runs) * (0.9 + 0.75 * len(depths))
    fig, axes = plt.subplots(
        1,
        len(runs),
        figsize=(width, 1.6 + 0.5 * len(lengths)),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, (name, cells) in zip(axes[0], runs, strict=True):
        grid = _grid(cells, lengths, depths)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("depth of the asked line")
        ax.set_title(name, fontsize=10)
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(
                    j, i, "-" if math.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=9
                )
    axes[0][0].set_ylabel("prompt tokens")
    fig.colorbar(image, ax=list(axes[0]), label="line retrieval accuracy", fraction=0.05)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m ringft.evals.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="eval-lines --output folders (or summary.csv files), in order")
    p.add_argument("--labels", nargs="+", default=None, help="one name per run (default: the folder names)")
    p.add_argument("--figure", default=None, help="write the side-by-side heatmaps to this PNG")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Print the comparison table; write the figure / Markdown file when asked."""
    args = parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        print(
            f"compare: error: {len(labels)} --labels for {len(args.runs)} runs: give one label per run",
            file=sys.stderr,
        )
        return 2
    try:
        runs = [(label, read_summary(run)) for label, run in zip(labels, args.runs, strict=True)]
    except ValueError as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    table = comparison_table(runs)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.figure:
        print(f"figure: {plot_comparison(runs, args.figure, args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
