"""Write a line-retrieval eval set (one JSON case per line).

Example::

    python data_prep/make_lines_eval.py --tokenizer demo --lengths 4096,8192 \\
        --depths 0,0.5,1 --cases 3 --seed 0 --prompt-style longchat --output cases.jsonl

Lengths accept a ``k`` suffix (``32k`` = 32768). Each case's prompt has at most the
requested number of tokens (BOS included when the tokenizer adds one) and is within one
record line of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # allow `python data_prep/make_lines_eval.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="Generate LongChat-style line-retrieval cases.")
    p.add_argument("--tokenizer", required=True, help="HF name/path, or 'demo'")
    p.add_argument("--lengths", required=True, help="comma list of token lengths, e.g. 4k,8192")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma list in [0, 1]")
    p.add_argument("--cases", type=int, default=3, help="cases per (length, depth) cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat-template",
        choices=("auto", "yes", "no"),
        default="auto",
        help="wrap prompts in the tokenizer's chat template (auto: if it has one)",
    )
    p.add_argument(
        "--prompt-style",
        choices=("longchat", "ringft"),
        default="longchat",
        help="record wording: LongChat's (default, as `ringft eval-lines`) or ringft's own",
    )
    p.add_argument("--output", type=Path, required=True, help="output .jsonl path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    from ringft.data.line_retrieval import RecordTooShortError
    from ringft.data.tokenizer import load_tokenizer
    from ringft.evals.checks import (
        EvalInputError,
        check_positive,
        parse_depths,
        parse_lengths,
        too_short_error,
    )
    from ringft.evals.lines.cases import make_line_cases
    from ringft.evals.lines.files import save_cases_jsonl

    args = parse_args(argv)
    try:
        lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
        check_positive("--cases", args.cases, "case per (length, depth) cell")
    except EvalInputError as exc:
        sys.exit(f"make_lines_eval.py: error: {exc}")
    chat = {"auto": None, "yes": True, "no": False}[args.chat_template]
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.time()
    try:
        cases = make_line_cases(
            tokenizer,
            lengths,
            depths,
            args.cases,
            args.seed,
            chat_template=chat,
            progress=True,
            prompt_style=args.prompt_style,
        )
    except RecordTooShortError as exc:
        sys.exit(f"make_lines_eval.py: error: {too_short_error(exc)}")
    save_cases_jsonl(cases, args.output)
    for length in lengths:
        cell = [c for c in cases if c.length == length]
        lines = sorted({c.num_lines for c in cell})
        toks = [c.num_tokens for c in cell]
        print(
            f"length {length}: {len(cell)} cases, lines {lines[0]}..{lines[-1]}, "
            f"tokens {min(toks)}..{max(toks)}"
        )
    print(f"wrote {len(cases)} cases to {args.output} in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
