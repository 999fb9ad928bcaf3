"""``ringft eval-ppl``'s outputs from its records: perplexity by length (``ppl.csv``), mean NLL by
position in log-spaced bins (``nll_by_position.csv``), ``summary.md``, the figure ``ppl.png``
(labelled a sanity check) and ``summary.json``."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from ringft.evals.figures import curves, model_name, write_summary_json
from ringft.evals.ppl.memory import describe_peak
from ringft.evals.ppl.variants import variant_label

SANITY = (
    "sanity check: low perplexity at long positions shows the model still models text there; it does "
    "not show that it uses the far context (see eval-niah / eval-ruler)"
)


def perplexity_by_length(records: list[dict[str, Any]]) -> dict[str, dict[int, tuple[float, int, int]]]:
    """``{variant: {L: (perplexity, documents, targets)}}``: exp of the mean NLL of tokens 1 .. L-1,
    pooled over the documents."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for length, total in r["nll_sum"].items():
            sums[r["variant"]][int(length)].append(total)
    out: dict[str, dict[int, tuple[float, int, int]]] = {}
    for variant, by_length in sums.items():
        out[variant] = {
            n: (math.exp(sum(v) / (len(v) * (n - 1))), len(v), len(v) * (n - 1))
            for n, v in sorted(by_length.items())
        }
    return out


def nll_by_position(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, float, int]]]:
    """``{variant: [(start, end, mean NLL, tokens)]}`` over the log-spaced position bins."""
    bins: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(dict)
    for r in records:
        for start, end, total, count in r["bins"]:
            acc = bins[r["variant"]].setdefault((start, end), [0.0, 0])
            acc[0] += total
            acc[1] += count
    return {v: [(a, b, s / c, c) for (a, b), (s, c) in sorted(by.items())] for v, by in bins.items()}


def write_ppl_summary(records: list[dict[str, Any]], ctx: Any, layout: Any, window: int | None) -> str:
    """Write the outputs of the module doc into ``--output``; the Markdown summary (``window``: the
    base model's native window, when a windowed variant ran)."""
    opts, folder = ctx.options, Path(ctx.options.output)
    ppl = perplexity_by_length(records)
    bins = nll_by_position(records)
    labels = {v: variant_label(v, opts, window) for v in ppl}
    with open(folder / "ppl.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["variant", "model", "length", "documents", "targets", "mean_nll", "perplexity"])
        for v, rows in ppl.items():
            for n, (value, docs, targets) in rows.items():
                writer.writerow([v, labels[v], n, docs, targets, f"{math.log(value):.6f}", f"{value:.4f}"])
    with open(folder / "nll_by_position.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["variant", "model", "start", "end", "tokens", "mean_nll"])
        for v, rows in bins.items():
            for start, end, mean, count in rows:
                writer.writerow([v, labels[v], start, end, count, f"{mean:.6f}"])
    lengths = sorted({n for rows in ppl.values() for n in rows})
    docs = max((docs for rows in ppl.values() for _, docs, _ in rows.values()), default=0)
    lines = [
        f"Perplexity over the first L tokens, {docs} document(s) of {lengths[-1]} tokens "
        f"(dp={layout.dp_size} x cp={layout.cp_size}); {SANITY}.",
        "",
        "| L | " + " | ".join(labels[v] for v in ppl) + " |",
        "|---:|" + "---:|" * len(ppl),
    ]
    for n in lengths:
        lines.append(
            f"| {n} | " + " | ".join(f"{ppl[v][n][0]:.3f}" if n in ppl[v] else "-" for v in ppl) + " |"
        )
    config = ctx.configs["model"]
    bytes_per = 4 if opts.dtype == "fp32" else 2
    lines += ["", describe_peak(config, lengths[-1], layout.cp_size, bytes_per, opts.chunk_size) + "."]
    text = "\n".join(lines)
    (folder / "summary.md").write_text(text + "\n")
    trained: dict[int, list[str]] = defaultdict(list)  # max_position_embeddings -> roles
    for role, config in ctx.configs.items():
        n = getattr(config, "max_position_embeddings", None)
        if n and n <= lengths[-1]:
            trained[n].append(role)
    vlines = [(n, f"{' & '.join(roles)} max positions {n}") for n, roles in sorted(trained.items())]
    centre = {
        v: ([math.sqrt(a * (b - 1)) if b - 1 > a else a for a, b, _, _ in rows], [m for _, _, m, _ in rows])
        for v, rows in bins.items()
    }
    curves(
        folder / "ppl.png",
        [
            {
                "series": {
                    labels[v]: (list(rows), [p for p, _, _ in rows.values()]) for v, rows in ppl.items()
                },
                "xlabel": "first L tokens",
                "ylabel": "perplexity",
                "logx": True,
                "logy": True,
                "vlines": vlines,
                "title": "perplexity over the first L tokens",
            },
            {
                "series": {labels[v]: xy for v, xy in centre.items()},
                "xlabel": "token position (log-binned)",
                "ylabel": "mean NLL (nats)",
                "logx": True,
                "vlines": vlines,
                "title": "NLL by position",
            },
        ],
        title=f"Sanity check, not a retrieval measure: {model_name(opts.model)}, {docs} document(s)",
    )
    write_summary_json(
        folder,
        {
            "command": "eval-ppl",
            "model": opts.model,
            "baseline": opts.baseline,
            "documents": docs,
            "perplexity": {
                labels[v]: {str(n): p for n, (p, _, _) in rows.items()} for v, rows in ppl.items()
            },
            "nll_by_position": {labels[v]: [list(r) for r in rows] for v, rows in bins.items()},
            "figures": ["ppl.png"],
            "markdown": text,
        },
    )
    return text + f"\nresults in {folder}/ (results.jsonl, ppl.csv, nll_by_position.csv, summary.md, ppl.png)"
