"""``ringft eval-ppl``: perplexity by length and NLL by position, on the CP ring.

Each document is cut to the longest ``--lengths`` value and evaluated by one ring forward; the NLL
of every token comes through the chunked LM head (:mod:`ringft.evals.ppl.nll`, no full logits).
Because attention is causal, the first L tokens' NLL from that forward is the NLL of a forward over
those L tokens alone, so one forward per document gives the perplexity over the first L tokens for
every ``--lengths`` value: ``exp(sum of the NLL of tokens 1 .. L-1 / (L - 1))`` pooled over the
documents. With ``--baseline MODEL`` the base model is evaluated too, in full and limited to its
native window (sliding windows of ``--native-window`` tokens, default its
``max_position_embeddings``, stride ``--stride``, default half the window). Outputs in
``--output``: ``results.jsonl``, ``ppl.csv``, ``nll_by_position.csv`` (log-binned),
``summary.md``, ``ppl.png`` (a sanity check: perplexity does not measure retrieval),
``summary.json``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from ringft.evals.checks import EvalInputError, check_positive, parse_lengths, position_warning
from ringft.evals.harness import task_main
from ringft.evals.ppl.summary import write_ppl_summary
from ringft.evals.ppl.texts import (
    Document,
    TextOptions,
    add_text_arguments,
    check_text_arguments,
    make_documents,
    read_texts,
)
from ringft.evals.ppl.variants import BASELINE, MODEL, WINDOW, same_model
from ringft.evals.task import Context, EvalTask, ModelRef, Runner
from ringft.utils.values import tokens_arg


@dataclass(frozen=True)
class PplCase:
    """One document evaluated by one variant (``window`` None: the full length in one forward)."""

    variant: str
    role: str
    index: int
    document: Document
    lengths: tuple[int, ...]
    window: int | None = None
    stride: int | None = None


@dataclass(frozen=True)
class PplOptions(TextOptions):
    """eval-ppl's options: the documents, ``--lengths`` (as given, and parsed, ascending) and the
    base model's variants (``--baseline``, ``--native-window``, ``--stride``)."""

    lengths: str
    length_list: tuple[int, ...]
    baseline: str | None
    native_window: int | None
    stride: int | None


class PplTask(EvalTask):
    """Perplexity by length / NLL by position."""

    command = "eval-ppl"
    default_output = "outputs/eval-ppl"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_text_arguments(parser)
        parser.add_argument("--lengths", default="4096,8192,16384,32768", help="lengths in tokens")
        parser.add_argument("--baseline", default=None, help="the base model, evaluated alongside")
        parser.add_argument(
            "--native-window", type=tokens_arg, default=None, help="the base model's own context"
        )
        parser.add_argument(
            "--stride", type=tokens_arg, default=None, help="sliding-window stride (default window/2)"
        )

    def options(self, args: argparse.Namespace) -> PplOptions:
        text = check_text_arguments(args)
        lengths = sorted(parse_lengths(args.lengths))
        if lengths[0] < 2:
            raise EvalInputError(f"--lengths {args.lengths}: a perplexity needs lengths of at least 2 tokens")
        for flag, value in (("--native-window", args.native_window), ("--stride", args.stride)):
            if value is not None:
                if args.baseline is None:
                    raise EvalInputError(
                        f"{flag} applies to the --baseline model: add --baseline or drop {flag}"
                    )
                check_positive(flag, value, "token")
        return PplOptions.pick(args, length_list=tuple(lengths), **text)

    def models(self, opts: PplOptions) -> list[ModelRef]:
        refs = [ModelRef("model", opts.model, opts.rope_theta)]
        return refs + (
            [ModelRef("baseline", opts.baseline)] if opts.baseline and not same_model(opts) else []
        )

    def settings(self, opts: PplOptions) -> dict[str, Any]:
        return {"task": self.command}

    def cases(self, ctx: Context) -> list[PplCase]:
        opts = ctx.options
        self.window: int | None = None
        longest = opts.length_list[-1]
        docs = make_documents(
            read_texts(opts.text, opts.text_field),
            ctx.tokenizer,
            longest,
            concat=opts.concat,
            max_docs=opts.num_docs,
        )
        lengths = tuple(opts.length_list)
        cases = [PplCase(MODEL, "model", i, d, lengths) for i, d in enumerate(docs)]
        if opts.baseline:
            role = "model" if same_model(opts) else "baseline"
            window = opts.native_window or getattr(ctx.configs[role], "max_position_embeddings", None)
            if window is None:
                raise EvalInputError(
                    f"--baseline {opts.baseline}: its config has no max_position_embeddings; "
                    "give --native-window"
                )
            stride = opts.stride or max(1, window // 2)
            if stride >= window:
                raise EvalInputError(
                    f"--stride {stride}: give a stride below the window ({window} tokens), so that every "
                    "token is predicted from at least one earlier token of its window"
                )
            self.window = window
            if role == "baseline":  # the same model in full is the "model" variant already
                cases += [PplCase(BASELINE, role, i, d, lengths) for i, d in enumerate(docs)]
            cases += [PplCase(WINDOW, role, i, d, lengths, window, stride) for i, d in enumerate(docs)]
        return cases

    def key(self, case: PplCase) -> str:
        lengths = ",".join(map(str, case.lengths))
        doc = case.document
        return f"{case.variant}|{case.index}|{doc.name}|{doc.digest}|{lengths}|{case.window}|{case.stride}"

    def roles(self, case: PplCase) -> tuple[str, ...]:
        return (case.role,)

    def warning(self, ctx: Context, cases: list[PplCase]) -> str | None:
        return position_warning(ctx.configs["model"], ctx.options.length_list[-1], 0)

    def evaluate(self, runner: Runner, case: PplCase) -> dict[str, Any]:
        from ringft.evals.ppl.nll import binned_sums, log_bins, prefix_sums, ring_token_nll, sliding_token_nll

        engine, ids, chunk = runner.engines[case.role], list(case.document.ids), runner.extra["chunk_size"]
        start = time.perf_counter()
        if case.window is None:
            nll = ring_token_nll(engine, ids, chunk)
        else:
            nll = sliding_token_nll(engine, ids, case.window, case.stride, chunk)
        return {
            "key": self.key(case),
            "variant": case.variant,
            "role": case.role,
            "document": case.document.name,
            "index": case.index,
            "tokens": len(ids),
            "window": case.window,
            "stride": case.stride,
            "nll_sum": prefix_sums(nll, case.lengths),
            "bins": binned_sums(nll, log_bins(len(ids))),
            "seconds": round(time.perf_counter() - start, 3),
        }

    def runner_extra(self, opts: PplOptions) -> dict[str, Any]:
        return {"chunk_size": opts.chunk_size}

    def finish(self, records: list[dict[str, Any]], ctx: Context, layout: Any) -> str:
        return write_ppl_summary(records, ctx, layout, self.window)


def main(argv: list[str] | None = None, load_model=None) -> int:
    """``ringft eval-ppl``; the exit code (0 ok, 2 bad input, 1 fault)."""
    return task_main(PplTask(), argv, load_model)
