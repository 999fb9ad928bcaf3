"""eval-ppl's section of ``ringft eval-report``: perplexity by length, and one figure of every run."""

from __future__ import annotations

from pathlib import Path

from ringft.evals.figures import curves
from ringft.evals.sections import Block, Run, by_length, images

TITLE = "Perplexity by length (a sanity check)"


def section(runs: list[Run], out: Path) -> list[Block]:
    """The table (rows = lengths, one column per run and variant), the combined figure (written
    beside ``out``) and each run's figures."""
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
    return [("table", by_length(runs, "perplexity", 3)), ("images", [("all runs", combined)]), images(runs)]
