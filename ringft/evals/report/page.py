"""``ringft eval-report DIR...``: one page from the ``--output`` folders of ``ringft eval-*`` runs.

Reads each folder's ``summary.json`` (an eval-lines folder without one: its
``summary.csv``) and writes one Markdown (``--output report.md``) or HTML (``report.html``) page with
a section per kind of run: perplexity by length, needle heatmaps, the RULER model x length table
with effective lengths, line retrieval by length, the short-context check. Runs of one kind sit
side by side (a base model and its extension: one column each), figures are linked relative to the
page, and a combined perplexity figure is drawn when there are perplexity runs.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringft.evals.figures import SUMMARY_JSON
from ringft.evals.lines import report as lines_report
from ringft.evals.lines.compare import accuracy_by_length, read_summary
from ringft.evals.niah import report as niah_report
from ringft.evals.ppl import report as ppl_report
from ringft.evals.ruler import report as ruler_report
from ringft.evals.sections import Block, Run
from ringft.evals.short import report as short_report
from ringft.ops.helptext import plain

#: The sections in page order: command -> (title, section), each task's ``report`` module.
SECTIONS: dict[str, tuple[str, Callable[[list[Run], Path], list[Block]]]] = {
    "eval-ppl": (ppl_report.TITLE, ppl_report.section),
    "eval-niah": (niah_report.TITLE, niah_report.section),
    "eval-ruler": (ruler_report.TITLE, ruler_report.section),
    "eval-lines": (lines_report.TITLE, lines_report.section),
    "eval-short": (short_report.TITLE, short_report.section),
}
ORDER = tuple(SECTIONS)


class ReportError(ValueError):
    """A folder that holds no eval summary (one line naming it)."""


def read_run(folder: str | Path) -> dict[str, Any]:
    """A run's summary: ``summary.json``, or an eval-lines ``summary.csv``. ReportError otherwise."""
    folder = Path(folder)
    path = folder / SUMMARY_JSON
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
        except ValueError as exc:
            raise ReportError(f"{path}: not JSON ({exc})") from None
        if summary.get("command") not in ORDER:
            raise ReportError(f"{path}: unknown command {summary.get('command')!r}")
        return {**summary, "folder": folder}
    if (folder / "summary.csv").is_file():
        accuracy = {str(n): a for n, (a, _) in accuracy_by_length(read_summary(folder)).items()}
        figures = ["heatmap.png"] if (folder / "heatmap.png").is_file() else []
        return {
            "command": "eval-lines",
            "model": "",
            "accuracy": accuracy,
            "figures": figures,
            "folder": folder,
        }
    raise ReportError(
        f"{folder}: no {SUMMARY_JSON} (give the --output folder of a finished ringft eval-* run)"
    )


def _markdown(title: str, sections: list[tuple[str, list[Block]]], out: Path) -> str:
    lines = [f"# {title}", ""]
    for heading, blocks in sections:
        lines += [f"## {heading}", ""]
        for kind, body in blocks:
            if kind == "text":
                lines += [body, ""]
            elif kind == "table":
                header, rows = body
                lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
            elif body:
                lines += ["| " + " | ".join(c for c, _ in body) + " |", "|" + "---|" * len(body)]
                lines += ["| " + " | ".join(f"![{c}]({_rel(p, out)})" for c, p in body) + " |", ""]
    return "\n".join(lines)


def _html(title: str, sections: list[tuple[str, list[Block]]], out: Path) -> str:
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
        "<style>table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "img{max-width:100%}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    for heading, blocks in sections:
        parts.append(f"<h2>{e(heading)}</h2>")
        for kind, body in blocks:
            if kind == "text":
                parts.append(f"<p>{e(body)}</p>")
            elif kind == "table":
                header, rows = body
                parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
                parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
                parts.append("</table>")
            elif body:
                cells = "".join(
                    f"<td><figure><img src='{e(_rel(p, out))}'><figcaption>{e(c)}</figcaption></figure></td>"
                    for c, p in body
                )
                parts.append(f"<table><tr>{cells}</tr></table>")
    return "\n".join(parts + ["</body></html>"])


def _rel(path: Path, out: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), out.parent.resolve())).as_posix()


def build_report(
    folders: list[str],
    output: str | Path,
    labels: list[str] | None = None,
    title: str = "Long-context evaluation",
) -> Path:
    """Write the page (HTML when ``output`` ends in .html, else Markdown); its path."""
    out = Path(output)
    runs = [read_run(f) for f in folders]
    names = labels or [Path(f).resolve().name for f in folders]
    if len(names) != len(runs):
        raise ReportError(f"{len(names)} --labels for {len(runs)} folders: give one label per folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = []
    for command in ORDER:
        mine = [(label, run) for label, run in zip(names, runs, strict=True) if run["command"] == command]
        if mine:
            title, section = SECTIONS[command]
            sections.append((title, section(mine, out)))
    render = _html if out.suffix.lower() in (".html", ".htm") else _markdown
    out.write_text(render(title, sections, out) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """``ringft eval-report DIR... [--output report.md] [--labels ...] [--title ...]``."""
    p = argparse.ArgumentParser(
        prog="ringft eval-report",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="--output folders of ringft eval-* runs")
    p.add_argument("--output", default="outputs/eval-report.md", help="report.md or report.html")
    p.add_argument("--labels", nargs="+", default=None, help="one name per folder (default: folder names)")
    p.add_argument("--title", default="Long-context evaluation")
    args = p.parse_args(argv)
    try:
        path = build_report(args.runs, args.output, args.labels, args.title)
    except ReportError as exc:
        print(f"ringft eval-report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"ringft eval-report: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1
    print(f"report: {path}")
    return 0
