"""eval-short's section of ``ringft eval-report``: one row per run, perplexities, KL and the verdict."""

from __future__ import annotations

from pathlib import Path

from ringft.evals.sections import Block, Run, fmt, images

TITLE = "Short-context regression check"
HEADER = ["model", "length", "base ppl", "model ppl", "change", "mean KL (nats)", "top-1 agreement", "flag"]


def section(runs: list[Run], out: Path) -> list[Block]:
    """One row per run, then each run's figures."""
    rows = [
        [
            label,
            str(run["length"]),
            fmt(run["ppl_base"], 3),
            fmt(run["ppl_model"], 3),
            f"{run['ppl_increase_pct']:+.2f}%",
            fmt(run["mean_kl"], 4),
            fmt(run["top1_agreement"], 3),
            "REGRESSION" if run["flagged"] else "ok",
        ]
        for label, run in runs
    ]
    return [("table", (HEADER, rows)), images(runs)]
