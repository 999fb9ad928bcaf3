"""``ringft eval-lines``: LongChat-style line retrieval at long context, run on the CP ring.

Launch like training (``accelerate launch ... -m ringft eval-lines ...``): world = dp x cp, each CP
group evaluates one case at a time: one prefill over the ring (no rank holds the whole sequence's
activations) serves both greedy generation with the distributed KV cache (exact, nothing
truncated, stops at EOS) and the teacher-forced probability of the answer; the DP groups split the
cases. Scoring (``--scoring``): LongChat's rule by default, the last integer of the output must equal
the stored number. Outputs in ``--output``: ``cases.jsonl`` (reusable with ``--cases-file``),
``results.jsonl`` (one line per case), ``summary.csv`` / ``summary.md`` (accuracy and mean answer
probability by length x depth), ``heatmap.png``, ``summary.json``. Re-running with the same
``--output`` and settings skips finished cases (see :mod:`ringft.evals.store`). A task of the
shared harness (:mod:`ringft.evals.harness`).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.data.line_retrieval import PROMPT_STYLES, RecordTooShortError
from ringft.evals.checks import (
    EvalInputError,
    check_positive,
    parse_depths,
    parse_lengths,
    position_warning,
    too_short_error,
)
from ringft.evals.figures import write_summary_json
from ringft.evals.harness import parse_task_args, stop_token_ids, task_main
from ringft.evals.lines.cases import LineCase, case_key, make_line_cases
from ringft.evals.lines.files import CasesFileError, load_cases_jsonl, save_cases_jsonl
from ringft.evals.lines.scoring import SCORING_RULES, score_answer
from ringft.evals.lines.summary import summarize
from ringft.evals.task import Context, EvalTask, Options, Runner

__all__ = [
    "LinesOptions",
    "LinesTask",
    "answer_token_ids",
    "evaluate_case",
    "main",
    "parse_args",
    "stop_token_ids",
]

DEFAULT_LENGTHS = "4096,8192"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
DEFAULT_CASES = 5


def answer_token_ids(tokenizer: Any, case: LineCase) -> list[int]:
    """The answer as the model would continue the prompt (a leading space after raw prompts; the
    bare number as the reply after a chat template's assistant header)."""
    text = case.answer if case.chat_template else " " + case.answer
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def evaluate_case(
    engine: Any, tokenizer: Any, case: LineCase, max_new_tokens: int, stop_ids: list[int]
) -> dict[str, Any]:
    """Generate and score one case with one prefill; the result record (unscored: the summary
    scores ``generated`` with the chosen rule)."""
    prompt_ids = case.input_ids(tokenizer)
    start = time.perf_counter()
    generated, logprob, argmax_ok = engine.generate_and_score(
        prompt_ids,
        answer_token_ids(tokenizer, case),
        max_new_tokens,
        eos_token_id=stop_ids,
    )
    return {
        "key": case_key(case),
        "source": case.source,
        "length": case.length,
        "depth": case.depth,
        "case_index": case.case_index,
        "num_lines": case.num_lines,
        "num_tokens": len(prompt_ids),
        "answer": case.answer,
        "target_line": case.target_line,
        "generated": tokenizer.decode(generated, skip_special_tokens=True),
        "generated_ids": list(generated),
        "answer_logprob": logprob,
        "answer_prob": math.exp(logprob),
        "teacher_forced_correct": bool(argmax_ok),
        "seconds": round(time.perf_counter() - start, 3),
    }


@dataclass(frozen=True)
class LinesOptions(Options):
    """eval-lines' options (None: not given; the defaults apply to generated cases only)."""

    lengths: str | None
    depths: str | None
    cases: int | None
    seed: int | None
    cases_file: str | None
    prompt_style: str | None
    scoring: str
    max_new_tokens: int


def _cases(opts: LinesOptions, tokenizer: Any) -> list[LineCase]:
    if opts.cases_file:
        flags = (("--lengths", opts.lengths), ("--depths", opts.depths), ("--cases", opts.cases))
        given = [f for f, v in (*flags, ("--seed", opts.seed)) if v is not None]
        if given:
            raise EvalInputError(f"{given[0]} is not used with --cases-file (its cases are fixed): drop it")
        try:
            cases = load_cases_jsonl(opts.cases_file, tokenizer)
        except FileNotFoundError:
            raise EvalInputError(f"--cases-file {opts.cases_file}: no such file") from None
        except CasesFileError as exc:
            raise EvalInputError(f"--cases-file: {exc}") from None
        styles = sorted({c.prompt_style for c in cases})
        if opts.prompt_style is not None and styles != [opts.prompt_style]:
            raise EvalInputError(
                f"--prompt-style {opts.prompt_style}: the cases of {opts.cases_file} are written in "
                f"style {', '.join(styles)}; drop --prompt-style"
            )
        return cases
    lengths = parse_lengths(DEFAULT_LENGTHS if opts.lengths is None else opts.lengths)
    depths = parse_depths(DEFAULT_DEPTHS if opts.depths is None else opts.depths)
    per_cell = DEFAULT_CASES if opts.cases is None else opts.cases
    check_positive("--cases", per_cell, "case per (length, depth) cell")
    style = opts.prompt_style or "longchat"
    seed = 0 if opts.seed is None else opts.seed
    try:
        return make_line_cases(tokenizer, lengths, depths, per_cell, seed, prompt_style=style)
    except RecordTooShortError as exc:
        raise too_short_error(exc) from None


class LinesTask(EvalTask):
    """Line retrieval on the harness."""

    command = "eval-lines"
    default_output = "outputs/eval-lines"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--lengths", default=None, help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS})"
        )
        p.add_argument(
            "--depths", default=None, help=f"depths of the asked line in [0, 1] (default {DEFAULT_DEPTHS})"
        )
        p.add_argument(
            "--cases", type=int, default=None, help=f"cases per (length, depth) (default {DEFAULT_CASES})"
        )
        p.add_argument("--seed", type=int, default=None, help="seed of the generated cases (default 0)")
        p.add_argument(
            "--cases-file",
            default=None,
            help="evaluate the cases of this jsonl instead of generating them: a cases.jsonl of ringft, "
            "or one of LongChat's lines test-case files (e.g. 200_lines.jsonl)",
        )
        p.add_argument(
            "--prompt-style",
            default=None,
            choices=sorted(PROMPT_STYLES),
            help="wording of the generated records: 'longchat' (default; LongChat's header and question, "
            "verbatim) or 'ringft' (the wording of ringft's synthetic training data)",
        )
        p.add_argument(
            "--scoring",
            default="longchat",
            choices=SCORING_RULES,
            help="'longchat' (default; LongChat's rule: the last integer of the output) or 'first-int'",
        )
        p.add_argument("--max-new-tokens", type=int, default=100, help="generation budget (LongChat: 100)")

    def options(self, args: argparse.Namespace) -> LinesOptions:
        check_positive("--max-new-tokens", args.max_new_tokens, "new token")
        return LinesOptions.pick(args)

    def settings(self, opts: LinesOptions) -> dict[str, Any]:
        return {"max_new_tokens": opts.max_new_tokens}

    def cases(self, ctx: Context) -> list[LineCase]:
        cases = _cases(ctx.options, ctx.tokenizer)
        self.style = cases[0].prompt_style
        return cases

    def key(self, case: LineCase) -> str:
        return case_key(case)

    def warning(self, ctx: Context, cases: list[LineCase]) -> str | None:
        longest = max(c.num_tokens for c in cases)
        return position_warning(ctx.configs["model"], longest, ctx.options.max_new_tokens)

    def save_cases(self, cases: list[LineCase], folder: Path) -> None:
        save_cases_jsonl(cases, folder / "cases.jsonl")

    def evaluate(self, runner: Runner, case: LineCase) -> dict[str, Any]:
        return evaluate_case(
            runner.engines["model"],
            runner.tokenizer,
            case,
            runner.extra["max_new_tokens"],
            runner.stop_ids["model"],
        )

    def runner_extra(self, opts: LinesOptions) -> dict[str, Any]:
        return {"max_new_tokens": opts.max_new_tokens}

    def score(self, records: list[dict[str, Any]], ctx: Context) -> None:
        for record in records:
            record["correct"] = score_answer(record["generated"], record["answer"], ctx.options.scoring)
            record["scoring"] = ctx.options.scoring

    def finish(self, records: list[dict[str, Any]], ctx: Context, layout: Any) -> str:
        opts, folder = ctx.options, Path(ctx.options.output)
        table = summarize(records, folder, opts.scoring, opts.max_new_tokens)
        accuracy: dict[int, list[float]] = {}
        for r in records:
            if r.get("source", "ringft") == "ringft":
                accuracy.setdefault(r["length"], []).append(float(r["correct"]))
        write_summary_json(
            folder,
            {
                "command": self.command,
                "model": opts.model,
                "accuracy": {str(n): sum(v) / len(v) for n, v in sorted(accuracy.items())},
                "figures": ["heatmap.png"],
                "markdown": table,
            },
        )
        return (
            f"\nline retrieval, {opts.model} (dp={layout.dp_size} x cp={layout.cp_size}, prompt style "
            f"{self.style}, scoring {opts.scoring}):\n{table}\n"
            f"results in {folder}/ (results.jsonl, summary.csv, summary.md, heatmap.png)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    return parse_task_args(LinesTask(), argv)


def main(argv: list[str] | None = None, load_model=None) -> int:
    """Entry point: 0 on success, 2 on a bad input, 1 on a fault. Either is named once, by the
    lowest rank that met it; the other ranks stop with it, without waiting (see
    :func:`ringft.ops.validate.fail_together`)."""
    return task_main(LinesTask(), argv, load_model)
