"""The ``ringft`` command: ``train``, ``eval-lines``, ``eval-ppl``, ``eval-niah``, ``eval-ruler``,
``eval-short``, ``eval-report``, ``plan``.

Each subcommand's own parser lives with its package (``ringft.train``, ``ringft.evals``,
``ringft.planner``); this module only dispatches. ``ringft SUBCOMMAND --help`` lists its options.
"""

from __future__ import annotations

import argparse
import sys


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ringft train",
        description="Fine-tune with a recipe (run under `accelerate launch`).",
        epilog="Any recipe key can be overridden: --train.max_steps 20 --parallel.cp_size 4",
    )
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--no-progress", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    from ringft.train import TrainError, load_recipe, train

    try:
        recipe = load_recipe(args.recipe, overrides)
        train(recipe, resume=args.resume, progress=not args.no_progress)
    except TrainError as exc:  # a refused recipe / data / checkpoint, a full disk: one line
        print(f"ringft train: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _eval_lines(argv: list[str]) -> int:
    from ringft.evals.lines import main as eval_main

    return eval_main(argv)


def _task(module: str):
    def run(argv: list[str]) -> int:
        from importlib import import_module

        return import_module(f"ringft.evals.{module}").main(argv)

    return run


def _plan(argv: list[str]) -> int:
    from ringft.planner import plan_main

    return plan_main(argv)


COMMANDS = {
    "train": _train,
    "eval-lines": _eval_lines,
    "eval-ppl": _task("ppl"),
    "eval-niah": _task("niah"),
    "eval-ruler": _task("ruler"),
    "eval-short": _task("short"),
    "eval-report": _task("report"),
    "plan": _plan,
}


def main(argv: list[str] | None = None) -> int:
    """Run ``ringft SUBCOMMAND ...`` (``argv`` defaults to ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: ringft {train,eval-lines,eval-ppl,eval-niah,eval-ruler,eval-short,eval-report,plan} ...\n"
            "  train RECIPE.yaml [--resume] [--section.key value ...]\n"
            "  eval-lines --model PATH --lengths 4096,8192 --depths 0,0.5,1 [--cp N]\n"
            "  eval-ppl --model PATH --text FILES --lengths 4k,8k,16k [--baseline BASE]\n"
            "  eval-niah --model PATH --lengths 4k,8k --depths 0,0.5,1 [--samples 5]\n"
            "  eval-ruler --model PATH --lengths 4k,8k,16k [--tasks ...] [--threshold 85.6]\n"
            "  eval-short --model PATH --baseline BASE --text FILES\n"
            "  eval-report DIR... [--output report.md|report.html]\n"
            "  plan --model llama-3-8b --seq-len 524288 --gpus 8 --gpu-mem 80 --zero 3"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
