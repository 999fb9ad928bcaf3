"""Everything ``eval-lines`` does before a model loads: check the inputs, load the tokenizer and
the model's config, build or read the cases, and open the resumable results. Reads only; each bad
input raises :class:`EvalInputError` (one line naming the value and the fix) on every rank."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringft.data.line_retrieval import (
    CasesFileError,
    LineCase,
    RecordTooShortError,
    load_cases_jsonl,
    make_line_cases,
)
from ringft.evals.checks import (
    EvalInputError,
    check_positive,
    check_vocabulary,
    parse_depths,
    parse_lengths,
    position_warning,
    too_short_error,
)
from ringft.evals.model import check_model_path, load_config, weights_identity
from ringft.evals.store import ResultsError, ResultsStore, tokenizer_identity
from ringft.ops.values import as_number

DEFAULT_LENGTHS = "4096,8192"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
DEFAULT_CASES = 5


@dataclass
class EvalPlan:
    """The checked inputs of one run: tokenizer, model config (no weights), cases, results store,
    finished records by case key, notes about repaired results files and a position warning."""

    tokenizer: Any
    config: Any
    cases: list[LineCase]
    store: ResultsStore
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warning: str | None = None


def _load_tokenizer(name: str) -> Any:
    from ringft.data.line_retrieval.tokenizer import load_tokenizer

    if name not in ("demo", "demo-lines"):
        check_model_path(name)  # the same "no such folder" rule as --model
    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvalInputError(f"--tokenizer {name}: cannot load a tokenizer from it ({reason})") from None


def _cases(args: argparse.Namespace, tokenizer: Any) -> list[LineCase]:
    if args.cases_file:
        given = [
            f
            for f, v in (
                ("--lengths", args.lengths),
                ("--depths", args.depths),
                ("--cases", args.cases),
                ("--seed", args.seed),
            )
            if v is not None
        ]
        if given:
            raise EvalInputError(f"{given[0]} is not used with --cases-file (its cases are fixed): drop it")
        try:
            cases = load_cases_jsonl(args.cases_file, tokenizer)
        except FileNotFoundError:
            raise EvalInputError(f"--cases-file {args.cases_file}: no such file") from None
        except CasesFileError as exc:
            raise EvalInputError(f"--cases-file: {exc}") from None
        styles = sorted({c.prompt_style for c in cases})
        if args.prompt_style is not None and styles != [args.prompt_style]:
            raise EvalInputError(
                f"--prompt-style {args.prompt_style}: the cases of {args.cases_file} are written in "
                f"style {', '.join(styles)}; drop --prompt-style"
            )
        return cases
    lengths = parse_lengths(DEFAULT_LENGTHS if args.lengths is None else args.lengths)
    depths = parse_depths(DEFAULT_DEPTHS if args.depths is None else args.depths)
    per_cell = DEFAULT_CASES if args.cases is None else args.cases
    check_positive("--cases", per_cell, "case per (length, depth) cell")
    style = args.prompt_style or "longchat"
    seed = 0 if args.seed is None else args.seed
    try:
        return make_line_cases(tokenizer, lengths, depths, per_cell, seed, prompt_style=style)
    except RecordTooShortError as exc:
        raise too_short_error(exc) from None


def settings_of(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """What the generated text depends on (see :mod:`ringft.evals.store`), as a JSON mapping."""
    local = Path(args.model).expanduser()
    return {
        "model": str(local.resolve()) if local.exists() else args.model,
        "weights": weights_identity(args.model),
        "tokenizer": tokenizer_identity(tokenizer),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "rope_theta": args.rope_theta,
    }


def prepare(args: argparse.Namespace) -> EvalPlan:
    """Check every input and read what the run needs, in the order a user would fix them; nothing
    is written and no model weights are read. EvalInputError on the first bad input."""
    check_positive("--max-new-tokens", args.max_new_tokens, "new token")
    fix = "give a positive RoPE base, e.g. 1e6"
    as_number("--rope-theta", args.rope_theta, gt=0, optional=True, fix=fix, error=EvalInputError)
    if args.cp is not None:
        check_positive("--cp", args.cp, "process per CP group")
    check_model_path(args.model)
    tokenizer = _load_tokenizer(args.tokenizer or args.model)
    try:
        config = load_config(args.model, args.rope_theta)
    except EvalInputError:
        raise
    except ValueError as exc:  # a config without RoPE parameters to override
        raise EvalInputError(str(exc)) from None
    check_vocabulary(tokenizer, config)
    cases = _cases(args, tokenizer)
    longest = max(c.num_tokens for c in cases)
    store = ResultsStore(args.output, settings_of(args, tokenizer))
    try:
        done, notes = store.load()
    except ResultsError as exc:
        raise EvalInputError(str(exc)) from None
    warning = position_warning(config, longest, args.max_new_tokens)
    return EvalPlan(tokenizer, config, cases, store, done, notes, warning)
