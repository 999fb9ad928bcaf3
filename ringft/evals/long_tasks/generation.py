"""The harness plug-in shared by ``ringft eval-niah`` and ``ringft eval-ruler``: the cases are
samples of :mod:`ringft.evals.long_tasks` (generated before any model loads, deterministic in
``--seed``), each evaluated by one ring prefill and greedy decoding of the task's
``tokens_to_generate`` (stop at EOS), scored with the task's metric; where the task defines the
exact correct continuation (passkey's ``" N"``), the same prefill also gives its teacher-forced
log-probability and whether every token of it is the argmax.

A length L means prompt + generated tokens <= L, counted with the model's chat template (RULER's
convention). Records keep the generated text and the score; they are keyed by the task's
fingerprint (generator and data versions), length, depth, index, seed and a hash of the prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from ringft.evals.checks import EvalInputError, check_positive, parse_lengths, position_warning
from ringft.evals.task import Context, EvalTask, Options, Runner


def sample_key(sample: Any, fingerprint: str) -> str:
    """A finished sample's key: the task's fingerprint, its cell, index and seed (readable) and a
    hash of its final prompt."""
    digest = hashlib.sha256(sample.prompt.encode()).hexdigest()[:16]
    return f"{fingerprint}|{sample.length}|{sample.depth}|{sample.index}|{sample.seed}|{digest}"


def resolve(names: str) -> list[Any]:
    """``--tasks`` as task specs; EvalInputError for an empty list, an unknown task, missing data."""
    from ringft.evals.long_tasks import RulerDataMissingError, WordListsMissingError, resolve_tasks

    try:
        return resolve_tasks(names)
    except (ValueError, RulerDataMissingError, WordListsMissingError) as exc:
        raise EvalInputError(f"--tasks {names!r}: {exc}") from None


@dataclass(frozen=True)
class GenerationOptions(Options):
    """The options of a generation task: ``--tasks`` (as given, and resolved to task specs),
    ``--lengths`` (as given, and parsed), ``--samples`` per cell and ``--seed``."""

    tasks: str
    lengths: str
    samples: int
    seed: int
    specs: tuple[Any, ...]
    length_list: tuple[int, ...]


class GenerationTask(EvalTask):
    """Samples of long-context tasks, generated and scored on the ring (see the module doc).
    Subclasses choose the cells (:meth:`cells`) and write the summaries."""

    default_tasks = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--tasks", default=self.default_tasks, help=f"comma-separated (default {self.default_tasks})"
        )
        parser.add_argument(
            "--lengths", default="4096,8192", help="sequence lengths in tokens (default 4096,8192)"
        )
        parser.add_argument("--samples", type=int, default=5, help="samples per cell (default 5)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")

    def generation_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        """The checked fields of :class:`GenerationOptions` that are parsed from the command line."""
        check_positive("--samples", args.samples, "sample per cell")
        if args.seed < 0:
            raise EvalInputError(f"--seed {args.seed}: give a seed >= 0")
        return {"length_list": tuple(parse_lengths(args.lengths)), "specs": tuple(resolve(args.tasks))}

    def options(self, args: argparse.Namespace) -> GenerationOptions:
        return GenerationOptions.pick(args, **self.generation_fields(args))

    def settings(self, opts: GenerationOptions) -> dict[str, Any]:
        return {"task": self.command}

    def cells(self, opts: Any) -> list[tuple[Any, int, float | None]]:
        """``(task spec, length, depth or None)`` of every cell, in order."""
        raise NotImplementedError

    def cases(self, ctx: Context) -> list[Any]:
        from tqdm.auto import tqdm

        from ringft.evals.long_tasks import generate_samples, task_fingerprint

        opts = ctx.options
        self.fingerprints = {spec.name: task_fingerprint(spec) for spec in opts.specs}
        cells = self.cells(opts)
        hide = opts.no_progress or not ctx.main
        samples = []
        for spec, length, depth in tqdm(cells, desc=f"{self.command} samples", disable=hide, file=sys.stdout):
            try:
                samples += generate_samples(
                    spec, ctx.tokenizer, length, opts.samples, seed=opts.seed, depth=depth
                )
            except ValueError as exc:  # LengthTooShortError, or a length below a task's own minimum
                raise EvalInputError(f"--lengths {opts.lengths}: {exc}") from None
        return samples

    def key(self, case: Any) -> str:
        return sample_key(case, self.fingerprints[case.task])

    def warning(self, ctx: Context, cases: list[Any]) -> str | None:
        longest = max(cases, key=lambda s: s.num_tokens + s.tokens_to_generate)
        return position_warning(ctx.configs["model"], longest.num_tokens, longest.tokens_to_generate)

    def save_cases(self, cases: list[Any], folder: Any) -> None:
        with open(folder / "samples.jsonl", "w") as fh:
            fh.writelines(s.to_json() + "\n" for s in cases)

    def evaluate(self, runner: Runner, case: Any) -> dict[str, Any]:
        from ringft.data.tokenizer import encode_prompt
        from ringft.evals.long_tasks import get_task

        tokenizer, engine = runner.tokenizer, runner.engines["model"]
        ids = encode_prompt(tokenizer, case.prompt, case.chat_template)
        if len(ids) != case.num_tokens:
            raise RuntimeError(
                f"{case.task} sample {case.index}: {len(ids)} prompt tokens, expected {case.num_tokens}"
            )
        start = time.perf_counter()
        record: dict[str, Any] = {}
        stops = runner.stop_ids["model"]
        if case.target is not None:
            target = list(tokenizer(case.target, add_special_tokens=False)["input_ids"])
            generated, logprob, argmax_ok = engine.generate_and_score(
                ids, target, case.tokens_to_generate, stops
            )
            record.update(target=case.target, target_logprob=logprob, teacher_forced_correct=bool(argmax_ok))
        else:
            generated = engine.generate(ids, case.tokens_to_generate, stops)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        return {
            "key": self.key(case),
            "task": case.task,
            "length": case.length,
            "depth": case.depth,
            "index": case.index,
            "seed": case.seed,
            "num_tokens": case.num_tokens,
            "tokens_to_generate": case.tokens_to_generate,
            "needle_depths": list(case.needle_depths),
            "outputs": list(case.outputs),
            "generated": text,
            "generated_ids": list(generated),
            "score": get_task(case.task).score(text, case.outputs),
            **record,
            "seconds": round(time.perf_counter() - start, 3),
        }
