"""``ringft eval-report DIR...``: one page from the ``--output`` folders of ``ringft eval-*`` runs.

Reads each folder's ``summary.json`` (an eval-lines folder written before it existed: its
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
from pathlib import Path
from typing import Any

from ringft.evals.figures import SUMMARY_JSON, curves
from ringft.ops.helptext import plain

ORDER = ("eval-ppl", "eval-niah", "eval-ruler", "eval-lines", "eval-short")
TITLES = {
    "eval-ppl": "Perplexity by length (a sanity check)",
    "eval-niah": "Needle in a haystack (passkey, niah_single_1)",
    "eval-ruler": "RULER",
    "eval-lines": "Line retrieval (LongChat)",
    "eval-short": "Short-context regression check",
}

Block = tuple[str, Any]  # ("text", str) | ("table", (header, rows)) | ("images", [(caption, path)])


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
        from ringft.evals.compare import accuracy_by_length, read_summary

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


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _by_length(runs: list[tuple[str, dict]], field: str, digits: int) -> tuple[list[str], list[list[str]]]:
    """Rows = lengths, one column per (run, series) of ``run[field]`` = ``{series: {L: value}}``."""
    columns = [(label, name, series) for label, run in runs for name, series in run[field].items()]
    lengths = sorted({int(n) for _, _, series in columns for n in series})
    header = ["L"] + [f"{label}: {name}" for label, name, _ in columns]
    rows = [[str(n)] + [_fmt(series.get(str(n)), digits) for _, _, series in columns] for n in lengths]
    return header, rows


def _images(runs: list[tuple[str, dict]]) -> Block:
    return "images", [(label, run["folder"] / f) for label, run in runs for f in run.get("figures", [])]


def _section(command: str, runs: list[tuple[str, dict]], out: Path) -> list[Block]:
    blocks: list[Block] = []
    if command == "eval-ppl":
        blocks.append(("table", _by_length(runs, "perplexity", 3)))
        series = {
            f"{label}: {name}": ([int(n) for n in s], list(s.values()))
            for label, run in runs
            for name, s in run["perplexity"].items()
        }
        combined = out.parent / f"{out.stem}-ppl.png"
        curves(
            combined,
            [{"series": series, "xlabel": "first L tokens", "ylabel": "perplexity", "logx": True}],
            title="Sanity check: perplexity over the first L tokens",
        )
        blocks.append(("images", [("all runs", combined)]))
    elif command == "eval-niah":
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
                    row.append(
                        _fmt(sum(c["score"] * c["samples"] for c in cells) / weight, 1) if weight else "-"
                    )
                rows.append(row)
        blocks.append(("text", "Score (% correct, greedy generation), averaged over the depths:"))
        blocks.append(("table", (header, rows)))
    elif command == "eval-ruler":
        lengths = sorted({int(n) for _, run in runs for n in run["average"]})
        header = ["model"] + [str(n) for n in lengths] + ["effective length"]
        rows = [
            [label]
            + [_fmt(run["average"].get(str(n)), 1) for n in lengths]
            + [f"{run['effective_length']} (threshold {run['threshold']:g})"]
            for label, run in runs
        ]
        blocks.append(("text", "Average over the tasks; per-task scores below."))
        blocks.append(("table", (header, rows)))
        tasks = sorted({t for _, run in runs for t in run["scores"]})
        header = ["task"] + [f"{label} @ {n}" for label, _ in runs for n in lengths]
        rows = [
            [t] + [_fmt(run["scores"].get(t, {}).get(str(n)), 1) for _, run in runs for n in lengths]
            for t in tasks
        ]
        blocks.append(("table", (header, rows)))
    elif command == "eval-lines":
        blocks.append(
            (
                "table",
                _by_length(
                    [(label, {"accuracy": {"accuracy": run["accuracy"]}}) for label, run in runs],
                    "accuracy",
                    2,
                ),
            )
        )
    elif command == "eval-short":
        header = [
            "model",
            "length",
            "base ppl",
            "model ppl",
            "change",
            "mean KL (nats)",
            "top-1 agreement",
            "flag",
        ]
        rows = [
            [
                label,
                str(run["length"]),
                _fmt(run["ppl_base"], 3),
                _fmt(run["ppl_model"], 3),
                f"{run['ppl_increase_pct']:+.2f}%",
                _fmt(run["mean_kl"], 4),
                _fmt(run["top1_agreement"], 3),
                "REGRESSION" if run["flagged"] else "ok",
            ]
            for label, run in runs
        ]
        blocks.append(("table", (header, rows)))
    blocks.append(_images(runs))
    return blocks


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
            sections.append((TITLES[command], _section(command, mine, out)))
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
