"""The evaluations' figures (matplotlib, Agg backend): annotated red-to-green heatmaps and curves
over log-scaled axes, plus the one place summaries are written as JSON for ``ringft eval-report``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUMMARY_JSON = "summary.json"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def model_name(path: str) -> str:
    """A model's short name for titles and labels: its folder (with the parent for a run's
    ``final`` / ``checkpoint-*`` folder)."""
    p = Path(path)
    if p.name == "final" or p.name.startswith("checkpoint"):
        return f"{p.parent.name}/{p.name}"
    return p.name or path


def fmt_cell(value: float, scale: float = 1.0) -> str:
    """A heatmap cell's text: ``-`` for a missing cell, else 2 decimals (0..1) or 0 decimals (0..100)."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.2f}" if scale <= 1 else f"{value:.0f}"


def heatmaps(
    path: Path,
    panels: Sequence[tuple[str, list[list[float]]]],
    rows: Sequence[str],
    columns: Sequence[str],
    *,
    xlabel: str,
    ylabel: str,
    colorbar: str,
    vmax: float = 1.0,
    title: str | None = None,
) -> Path:
    """One figure with a heatmap per panel (``(title, grid rows x columns)``; NaN = no data),
    sharing the axes and the red (0) to green (``vmax``) colour scale, each cell annotated."""
    plt = _pyplot()
    width = 1.2 + len(panels) * (1.0 + 0.75 * len(columns))
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(width, 1.6 + 0.5 * len(rows)),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, (name, grid) in zip(axes[0], panels, strict=True):
        image = ax.imshow(grid, vmin=0, vmax=vmax, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(columns)), list(columns))
        ax.set_yticks(range(len(rows)), list(rows))
        ax.set_xlabel(xlabel)
        ax.set_title(name, fontsize=10)
        for i, values in enumerate(grid):
            for j, value in enumerate(values):
                ax.text(j, i, fmt_cell(value, vmax), ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.colorbar(image, ax=list(axes[0]), label=colorbar, fraction=0.05)
    if title:
        fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def curves(
    path: Path,
    panels: Sequence[dict[str, Any]],
    *,
    title: str | None = None,
) -> Path:
    """Side-by-side line plots. Each panel: ``series`` ``{label: (xs, ys)}``, ``xlabel``,
    ``ylabel``, optional ``title``, ``logx`` (base 2), ``logy``, ``hline`` ``(y, label)``."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False, layout="constrained"
    )
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in panel["series"].items():
            ax.plot(
                xs,
                ys,
                marker="o",
                markersize=3,
                label=label,
                linewidth=panel.get("width", {}).get(label, 1.4),
            )
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        if panel.get("hline"):
            y, label = panel["hline"]
            ax.axhline(y, color="grey", linestyle="--", linewidth=1, label=label)
        for x, label in panel.get("vlines", ()):
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
            ax.annotate(
                label,
                (x, 0.98),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                ha="right",
                va="top",
                rotation=90,
            )
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        if panel.get("title"):
            ax.set_title(panel["title"], fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_summary_json(folder: Path, summary: dict[str, Any]) -> Path:
    """``folder/summary.json``: what ``ringft eval-report`` collects (``command``, ``model``,
    the task's figures, ``figures`` relative to the folder, ``markdown``)."""
    path = folder / SUMMARY_JSON
    path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return path
