"""``ringft eval-short``: did context extension cost short-context quality? A regression proxy
against the base model on held-out text, on the CP ring.

Documents of ``--length`` tokens (default: the base model's ``max_position_embeddings``, its
original context) go through both models (one ring forward each, the head in token chunks); per
token: both NLLs, KL(p_base || p_model) and whether both models' top-1 next token agree. Reported:
both perplexities, the relative perplexity increase, the mean KL in nats per token and the top-1
agreement; flagged as a regression when the perplexity rises by more than ``--max-ppl-increase``
percent (default 5). A proxy only: for task accuracy run lm-evaluation-harness on the checkpoint
(docs/evaluation.md). Outputs in ``--output``: ``results.jsonl``, ``short.csv``, ``summary.md``,
``summary.json``.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.evals.checks import EvalInputError, check_positive
from ringft.evals.figures import write_summary_json
from ringft.evals.harness import task_main
from ringft.evals.ppl.nll import ring_compare
from ringft.evals.ppl.texts import (
    Document,
    TextOptions,
    add_text_arguments,
    check_text_arguments,
    make_documents,
    read_texts,
)
from ringft.evals.task import Context, EvalTask, ModelRef, Runner


def regression_verdict(ppl_base: float, ppl_model: float, max_increase: float) -> tuple[float, bool]:
    """``(relative perplexity increase in percent, whether it exceeds max_increase)``."""
    increase = 100.0 * (ppl_model / ppl_base - 1.0)
    return increase, ppl_model > ppl_base * (1.0 + max_increase / 100.0)  # a rise of exactly the limit passes


@dataclass(frozen=True)
class ShortOptions(TextOptions):
    """eval-short's options: the documents, the base model, ``--length`` (None: the base model's
    context) and the regression limit ``--max-ppl-increase`` in percent."""

    baseline: str
    length: int | None
    max_ppl_increase: float


class ShortTask(EvalTask):
    """Short-context regression against the base model."""

    command = "eval-short"
    default_output = "outputs/eval-short"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_text_arguments(parser)
        parser.add_argument("--baseline", required=True, help="the base model (before extension)")
        parser.add_argument(
            "--length", type=int, default=None, help="tokens per document (default: base context)"
        )
        parser.add_argument(
            "--max-ppl-increase", type=float, default=5.0, help="flag above this %% (default 5)"
        )

    def options(self, args: argparse.Namespace) -> ShortOptions:
        text = check_text_arguments(args)
        if args.length is not None:
            check_positive("--length", args.length, "token")
            if args.length < 2:
                raise EvalInputError(f"--length {args.length}: a perplexity needs at least 2 tokens")
        if not (math.isfinite(args.max_ppl_increase) and args.max_ppl_increase >= 0):
            raise EvalInputError(
                f"--max-ppl-increase {args.max_ppl_increase}: give a percentage >= 0, e.g. 5"
            )
        return ShortOptions.pick(args, **text)

    def models(self, opts: ShortOptions) -> list[ModelRef]:
        return [ModelRef("model", opts.model, opts.rope_theta), ModelRef("baseline", opts.baseline)]

    def settings(self, opts: ShortOptions) -> dict[str, Any]:
        return {"task": self.command}

    def cases(self, ctx: Context) -> list[Document]:
        opts = ctx.options
        length = opts.length or getattr(ctx.configs["baseline"], "max_position_embeddings", None)
        if length is None:
            raise EvalInputError(
                f"--baseline {opts.baseline}: no max_position_embeddings in its config; give --length"
            )
        self.length = length
        texts = read_texts(opts.text, opts.text_field)
        return make_documents(
            texts, ctx.tokenizer, length, concat=opts.concat, max_docs=opts.num_docs, flag="--length"
        )

    def key(self, case: Document) -> str:
        return f"{case.name}|{case.digest}|{len(case.ids)}"

    def roles(self, case: Document) -> tuple[str, ...]:
        return ("baseline", "model")

    def runner_extra(self, opts: ShortOptions) -> dict[str, Any]:
        return {"chunk_size": opts.chunk_size}

    def evaluate(self, runner: Runner, case: Document) -> dict[str, Any]:
        start = time.perf_counter()
        sums = ring_compare(
            runner.engines["baseline"], runner.engines["model"], list(case.ids), runner.extra["chunk_size"]
        )
        return {
            "key": self.key(case),
            "document": case.name,
            "tokens": len(case.ids),
            **sums,
            "seconds": round(time.perf_counter() - start, 3),
        }

    def finish(self, records: list[dict[str, Any]], ctx: Context, layout: Any) -> str:
        opts, folder = ctx.options, Path(ctx.options.output)
        n = int(sum(r["targets"] for r in records))
        ppl_base = math.exp(sum(r["nll_reference"] for r in records) / n)
        ppl_model = math.exp(sum(r["nll_model"] for r in records) / n)
        kl = sum(r["kl"] for r in records) / n
        agree = sum(r["top1_agree"] for r in records) / n
        increase, flagged = regression_verdict(ppl_base, ppl_model, opts.max_ppl_increase)
        with open(folder / "short.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(
                [
                    "documents",
                    "length",
                    "targets",
                    "ppl_base",
                    "ppl_model",
                    "ppl_increase_pct",
                    "mean_kl_nats",
                    "top1_agreement",
                    "flagged",
                ]
            )
            writer.writerow(
                [
                    len(records),
                    self.length,
                    n,
                    f"{ppl_base:.4f}",
                    f"{ppl_model:.4f}",
                    f"{increase:.2f}",
                    f"{kl:.6f}",
                    f"{agree:.4f}",
                    flagged,
                ]
            )
        limit = opts.max_ppl_increase
        verdict = (
            f"REGRESSION: perplexity up {increase:.1f}% (> {limit:g}%)"
            if flagged
            else f"no regression flagged (perplexity change {increase:+.1f}%, limit +{limit:g}%)"
        )
        text = "\n".join(
            [
                f"Short-context check at {self.length} tokens, {len(records)} document(s), "
                f"{n} targets "
                f"(dp={layout.dp_size} x cp={layout.cp_size}):",
                "",
                "| base perplexity | model perplexity | change | mean KL(base \\|\\| model) "
                "| top-1 agreement |",
                "|---:|---:|---:|---:|---:|",
                f"| {ppl_base:.3f} | {ppl_model:.3f} | {increase:+.2f}% | {kl:.4f} nats | {agree:.3f} |",
                "",
                verdict,
            ]
        )
        (folder / "summary.md").write_text(text + "\n")
        write_summary_json(
            folder,
            {
                "command": self.command,
                "model": opts.model,
                "baseline": opts.baseline,
                "length": self.length,
                "documents": len(records),
                "ppl_base": ppl_base,
                "ppl_model": ppl_model,
                "ppl_increase_pct": increase,
                "mean_kl": kl,
                "top1_agreement": agree,
                "flagged": flagged,
                "threshold_pct": opts.max_ppl_increase,
                "figures": [],
                "markdown": text,
            },
        )
        return text + f"\nresults in {folder}/ (results.jsonl, short.csv, summary.md)"


def main(argv: list[str] | None = None, load_model=None) -> int:
    """``ringft eval-short``; the exit code (0 ok, 2 bad input, 1 fault)."""
    return task_main(ShortTask(), argv, load_model)
