"""The ``ringft`` command: ``train``, ``eval-lines``, ``eval-ppl``, ``eval-niah``, ``eval-ruler``,
``eval-short``, ``eval-report``, ``plan``.

Each subcommand's own parser lives with its package (``ringft.train``, ``ringft.evals``,
``ringft.planner``); this module only dispatches. ``ringft SUBCOMMAND --help`` lists its options;
``ringft --version`` prints the version; a mistyped subcommand is named with the closest one.
"""

from __future__ import annotations

import argparse
import difflib
import sys


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ringft train",
        description="Fine-tune with a recipe YAML (run under `accelerate launch`; docs/recipes.md).",
        epilog="Any recipe key can be overridden: --train.max_steps 20 --parallel.cp_size=4",
    )
    parser.add_argument("recipe", help="recipe YAML file (`ringft plan ... --write-recipe` writes one)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the newest complete checkpoint (or from the checkpoint folder PATH)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--engine",
        choices=("trainer", "loop"),
        default="trainer",
        help="trainer (default): transformers.Trainer with RingTrainerMixin, HF checkpoint-N folders; "
        "loop: ringft's own training loop (checkpoints/step-N folders)",
    )
    args, overrides = parser.parse_known_args(argv)
    from ringft.train import TrainError, load_recipe

    if args.engine == "trainer":
        from ringft.train.front import train
    else:
        from ringft.train.loop import train

        if isinstance(args.resume, str):
            parser.error("--resume PATH is not supported by --engine loop (it resumes its newest checkpoint)")
    try:
        recipe = load_recipe(args.recipe, overrides)
        train(recipe, resume=args.resume, progress=not args.no_progress)
    except TrainError as exc:  # a refused recipe / data / checkpoint, a full disk: one line
        print(f"ringft train: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _eval_lines(argv: list[str]) -> int:
    from ringft.evals.lines.task import main as eval_main

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
    "eval-ppl": _task("ppl.task"),
    "eval-niah": _task("niah.task"),
    "eval-ruler": _task("ruler.task"),
    "eval-short": _task("short.task"),
    "eval-report": _task("report.page"),
    "plan": _plan,
}


USAGE = """usage: ringft {train,eval-lines,eval-ppl,eval-niah,eval-ruler,eval-short,eval-report,plan} ...
  train RECIPE.yaml [--resume] [--section.key value ...]
  eval-lines --model PATH --lengths 4096,8192 --depths 0,0.5,1 [--cp N]
  eval-ppl --model PATH --text FILES --lengths 4k,8k,16k [--baseline BASE]
  eval-niah --model PATH --lengths 4k,8k --depths 0,0.5,1 [--samples 5]
  eval-ruler --model PATH --lengths 4k,8k,16k [--tasks ...] [--threshold 85.6]
  eval-short --model PATH --baseline BASE --text FILES
  eval-report DIR... [--output report.md|report.html]
  plan --model llama-3-8b --seq-len 512k --gpus 8 --gpu-mem 80 --zero 3 [--write-recipe r.yaml]
ringft SUBCOMMAND --help: its options; ringft --version"""


def main(argv: list[str] | None = None) -> int:
    """Run ``ringft SUBCOMMAND ...`` (``argv`` defaults to ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        package = sys.modules[__name__.rpartition(".")[0]]  # ringft, imported before this module
        print(f"ringft {package.__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(
            f"ringft: error: unknown subcommand {argv[0]!r}: {hint}choose from {', '.join(COMMANDS)} "
            "(ringft --help)",
            file=sys.stderr,
        )
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
