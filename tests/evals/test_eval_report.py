"""``ringft eval-report``: runs' summaries (as the eval commands write them) into one Markdown or HTML
page, base and extended side by side; an eval-lines folder without summary.json is read from its
summary.csv; bad folders and label counts are one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest


def _run(folder: Path, summary: dict, figure: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    if figure:
        (folder / figure).write_bytes(b"\x89PNG\r\n\x1a\n")
    return folder


@pytest.fixture()
def runs(tmp_path) -> list[Path]:
    ppl = {"perplexity": {"base": {"128": 9.0, "512": 40.0}, "base (sliding 128)": {"128": 9.0, "512": 8.5}}}
    ext = {"perplexity": {"extended": {"128": 9.2, "512": 7.9}}}
    ruler = {
        "command": "eval-ruler",
        "threshold": 85.6,
        "scores": {"vt": {"4096": 90.0, "8192": 40.0}},
        "average": {"4096": 90.0, "8192": 40.0},
        "effective_length": "4K",
        "figures": ["ruler.png"],
    }
    niah = {
        "command": "eval-niah",
        "figures": ["heatmap.png"],
        "cells": [
            {"task": "passkey", "length": 4096, "depth": 0.0, "samples": 2, "score": 100.0},
            {"task": "passkey", "length": 4096, "depth": 1.0, "samples": 2, "score": 50.0},
        ],
    }
    short = {
        "command": "eval-short",
        "length": 128,
        "ppl_base": 9.0,
        "ppl_model": 9.9,
        "ppl_increase_pct": 10.0,
        "mean_kl": 0.02,
        "top1_agreement": 0.93,
        "flagged": True,
        "figures": [],
    }
    lines = tmp_path / "old-lines"
    lines.mkdir()
    (lines / "summary.csv").write_text(
        "length,depth,cases,accuracy\n120,0.0,2,1.0\n120,1.0,2,0.5\n500,0.0,4,0.25\n"
    )
    return [
        _run(tmp_path / "base-ppl", {"command": "eval-ppl", "figures": ["ppl.png"], **ppl}, "ppl.png"),
        _run(tmp_path / "ext-ppl", {"command": "eval-ppl", "figures": ["ppl.png"], **ext}, "ppl.png"),
        _run(tmp_path / "ruler", ruler, "ruler.png"),
        _run(tmp_path / "niah", niah, "heatmap.png"),
        _run(tmp_path / "short", short),
        lines,
    ]


def test_markdown_and_html_pages(runs, tmp_path):
    from ringft.evals.report.page import build_report

    labels = ["base", "extended", "extended", "extended", "extended vs base", "base"]
    page = build_report([str(r) for r in runs], tmp_path / "report" / "page.md", labels)
    text = page.read_text()
    assert (
        text.index("## Perplexity") < text.index("## Needle") < text.index("## RULER") < text.index("## Line")
    )
    assert "| L | base: base | base: base (sliding 128) | extended: extended |" in text
    assert "| 512 | 40.000 | 8.500 | 7.900 |" in text
    assert "| extended | 90.0 | 40.0 | 4K (threshold 85.6) |" in text  # the model x length table
    assert "| passkey | 4096 | 75.0 |" in text  # mean over the depths, weighted by samples
    assert "| extended vs base | 128 | 9.000 | 9.900 | +10.00% | 0.0200 | 0.930 | REGRESSION |" in text
    assert "| 120 | 0.75 |" in text and "| 500 | 0.25 |" in text  # read from the old summary.csv
    assert "![base](../base-ppl/ppl.png)" in text and "![all runs](page-ppl.png)" in text
    assert (tmp_path / "report" / "page-ppl.png").is_file()
    html = build_report([str(r) for r in runs], tmp_path / "report" / "page.html", labels).read_text()
    assert html.startswith("<!doctype html>") and "<img src='../ruler/ruler.png'>" in html
    assert "<td>REGRESSION</td>" in html


def test_bad_folders_are_one_line(runs, tmp_path):
    from ringft.cli import main

    for argv, expected in (
        ([str(tmp_path / "nothing")], f"{tmp_path / 'nothing'}: no summary.json"),
        ([str(runs[0]), "--labels", "a", "b"], "2 --labels for 1 folders: give one label per folder"),
    ):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["eval-report", *argv, "--output", str(tmp_path / "r.md")])
        assert code == 2 and err.getvalue().count("\n") == 1 and expected in err.getvalue(), err.getvalue()
    assert not (tmp_path / "r.md").exists()
