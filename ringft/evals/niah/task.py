"""``ringft eval-niah``: passkey (LongLoRA's format) and needle (RULER's niah_single_1) retrieval
over a length x depth grid, on the CP ring.

Each cell holds ``--samples`` samples (:mod:`ringft.evals.long_tasks`, deterministic in ``--seed``;
the cells of one length and sample index share their key, only the needle moves). Scores: passkey
by LongLoRA's exact match, the needle by RULER's ``string_match_all``, both of a greedy
generation; passkey also by teacher forcing (every token of the key the argmax). Outputs in
``--output``: ``samples.jsonl``, ``results.jsonl``, ``niah.csv`` (one row per task x length x depth),
``summary.md``, ``heatmap.png`` (red 0 to green 100, one panel per task), ``summary.json``.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.evals.checks import EvalInputError, parse_depths
from ringft.evals.figures import heatmaps, model_name, write_summary_json
from ringft.evals.harness import task_main
from ringft.evals.long_tasks.generation import GenerationOptions, GenerationTask
from ringft.evals.task import Context


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass(frozen=True)
class NiahOptions(GenerationOptions):
    """eval-niah's options: the generation options and the needle depths (parsed ``--depths``)."""

    depths: str
    depth_list: tuple[float, ...]


class NiahTask(GenerationTask):
    """The length x depth grid of passkey / needle samples."""

    command = "eval-niah"
    default_output = "outputs/eval-niah"
    default_tasks = "passkey,niah_single_1"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")

    def options(self, args: argparse.Namespace) -> NiahOptions:
        parsed = self.generation_fields(args)
        depths = parse_depths(args.depths, "0 = needle at the start of the context, 1 = at the end")
        flat = [s.name for s in parsed["specs"] if not s.supports_depth]
        if flat:
            raise EvalInputError(
                f"--tasks {args.tasks}: {', '.join(flat)} takes no needle depth; eval-niah runs "
                "passkey, niah_single_1/2/3, niah_multikey_2/3 (use eval-ruler for the others)"
            )
        return NiahOptions.pick(args, depth_list=tuple(depths), **parsed)

    def cells(self, opts: NiahOptions) -> list[tuple[Any, int, float | None]]:
        return [(s, n, d) for s in opts.specs for n in opts.length_list for d in opts.depth_list]

    def finish(self, records: list[dict[str, Any]], ctx: Context, layout: Any) -> str:
        folder = Path(ctx.options.output)
        cells: dict[tuple[str, int, float], list[dict]] = defaultdict(list)
        for r in records:
            cells[(r["task"], r["length"], r["depth"])].append(r)
        tasks = list(dict.fromkeys(r["task"] for r in records))
        lengths = sorted({r["length"] for r in records})
        depths = sorted({r["depth"] for r in records})
        rows = []
        for (task, length, depth), rs in cells.items():
            forced = [float(r["teacher_forced_correct"]) for r in rs if "teacher_forced_correct" in r]
            rows.append(
                {
                    "task": task,
                    "length": length,
                    "depth": depth,
                    "samples": len(rs),
                    "mean_tokens": round(_mean([r["num_tokens"] for r in rs]), 1),
                    "score": round(100 * _mean([r["score"] for r in rs]), 2),
                    "teacher_forced": round(100 * _mean(forced), 2) if forced else None,
                }
            )
        with open(folder / "niah.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        score = {(r["task"], r["length"], r["depth"]): r["score"] for r in rows}
        panels = [
            (task, [[score.get((task, n, d), float("nan")) for d in depths] for n in lengths])
            for task in tasks
        ]
        heads = [f"{d:.0%}" for d in depths]
        per_cell = f"{ctx.options.samples} sample{'s' if ctx.options.samples != 1 else ''} per cell"
        heatmaps(
            folder / "heatmap.png",
            panels,
            [str(n) for n in lengths],
            heads,
            xlabel="needle depth",
            ylabel="sequence tokens",
            colorbar="score (greedy generation)",
            vmax=100,
            title=f"{model_name(ctx.options.model)}: needle retrieval\n{per_cell}",
        )
        lines = [
            f"Needle retrieval, {ctx.options.model} (dp={layout.dp_size} x cp={layout.cp_size}); "
            f"score = % correct by greedy generation, {per_cell}."
        ]
        for task, grid in panels:
            lines += ["", f"{task}:", "", "| tokens \\ depth | " + " | ".join(heads) + " | all |"]
            lines.append("|---:|" + "---:|" * (len(depths) + 1))
            for n, values in zip(lengths, grid, strict=True):
                every = [r["score"] for r in records if r["task"] == task and r["length"] == n]
                cells_text = " | ".join("-" if v != v else f"{v:.0f}" for v in values)
                lines.append(f"| {n} | {cells_text} | {100 * _mean(every):.0f} |")
        text = "\n".join(lines)
        (folder / "summary.md").write_text(text + "\n")
        write_summary_json(
            folder,
            {
                "command": self.command,
                "model": ctx.options.model,
                "samples": ctx.options.samples,
                "lengths": lengths,
                "depths": depths,
                "cells": rows,
                "figures": ["heatmap.png"],
                "markdown": text,
            },
        )
        return text + f"\nresults in {folder}/ (results.jsonl, niah.csv, summary.md, heatmap.png)"


def main(argv: list[str] | None = None, load_model=None) -> int:
    """``ringft eval-niah``; the exit code (0 ok, 2 bad input, 1 fault)."""
    return task_main(NiahTask(), argv, load_model)
