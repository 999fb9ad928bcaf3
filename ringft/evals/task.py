"""What a task plugs into the evaluation harness (:mod:`ringft.evals.harness`): the :class:`EvalTask`
interface, its typed options (:class:`Options`, one frozen dataclass per task, built and checked once
from the command line), the :class:`Context` a task sees before any model loads and the
:class:`Runner` it evaluates a case with. Tasks import this module; it imports no task.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

#: ``load_model(path, dtype, device, rope_theta) -> model``; the default reads the weights
#: (:func:`ringft.evals.model.load_eval_model`). Tests pass one that reuses a loaded model.
ModelLoader = Callable[[str, torch.dtype, torch.device, "float | None"], torch.nn.Module]


@dataclass(frozen=True)
class ModelRef:
    """One model a task evaluates: its ``role`` ("model"; "baseline" for a base model), its
    ``path`` (folder, hub name or LoRA adapter folder) and a RoPE theta override."""

    role: str
    path: str
    rope_theta: float | None = None


@dataclass(frozen=True)
class Options:
    """The options every eval command takes (:func:`ringft.evals.harness.add_common_arguments`);
    a task's own options subclass it. Built once from the command line by :meth:`EvalTask.options`,
    which checks them; never changed afterwards."""

    model: str
    tokenizer: str | None
    cp_size: int | None
    output: str
    attn_backend: str
    dtype: str
    rope_theta: float | None
    no_progress: bool

    @classmethod
    def pick(cls, args: argparse.Namespace, **parsed: Any) -> Any:
        """The fields of ``cls`` read from the parsed command line; ``parsed`` gives the fields
        that are not options as typed (lengths parsed from ``--lengths``, ...)."""
        return cls(
            **{f.name: parsed[f.name] if f.name in parsed else getattr(args, f.name) for f in fields(cls)}
        )


@dataclass
class Context:
    """What a task sees before any model loads: its checked options, the tokenizer, each role's
    config (no weights), the number of processes and whether this is the main process."""

    options: Any
    tokenizer: Any
    configs: dict[str, Any]
    processes: int = 1
    main: bool = True


@dataclass
class Runner:
    """What :meth:`EvalTask.evaluate` gets: the ring engine of each loaded role
    (:class:`ringft.model.inference.RingInference`), the tokenizer, each role's generation stop
    ids, and the task's :meth:`EvalTask.runner_extra` values."""

    engines: dict[str, Any]
    tokenizer: Any
    stop_ids: dict[str, list[int]]
    extra: dict[str, Any] = field(default_factory=dict)


class EvalTask:
    """A task plugged into the harness. Override what differs; every method runs on every rank."""

    command = "eval"  #: the subcommand, e.g. "eval-lines" (messages start "ringft <command>:")
    default_output = "outputs/eval"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The task's own options (the common ones are :func:`add_common_arguments`)."""

    def options(self, args: argparse.Namespace) -> Options:
        """The task's typed options from the parsed command line, checked (EvalInputError); called
        once, before anything is read."""
        return Options.pick(args)

    def models(self, opts: Any) -> list[ModelRef]:
        """The models the run evaluates; the first is the one under evaluation ("model")."""
        return [ModelRef("model", opts.model, opts.rope_theta)]

    def settings(self, opts: Any) -> dict[str, Any]:
        """Task options that change every case's result (stored results are keyed by them)."""
        return {}

    def cases(self, ctx: Context) -> list[Any]:
        """Every case of the run, in order, built with no model loaded (EvalInputError)."""
        raise NotImplementedError

    def key(self, case: Any) -> str:
        """A finished case's key in the results (everything about the case that changes its result)."""
        raise NotImplementedError

    def roles(self, case: Any) -> tuple[str, ...]:
        """The models a case runs on (all loaded together); consecutive cases share loads."""
        return ("model",)

    def warning(self, ctx: Context, cases: list[Any]) -> str | None:
        """One warning line for the main process (positions past the trained length), or None."""
        return None

    def save_cases(self, cases: list[Any], folder: Any) -> None:
        """Main process, before evaluating: write the cases for reuse (optional)."""

    def runner_extra(self, opts: Any) -> dict[str, Any]:
        """Task values handed to :meth:`evaluate` in ``Runner.extra``."""
        return {}

    def evaluate(self, runner: Runner, case: Any) -> dict[str, Any]:
        """Evaluate one case on the ring (every rank of the CP group calls it); its JSON record."""
        raise NotImplementedError

    def score(self, records: list[dict[str, Any]], ctx: Context) -> None:
        """Main process, before ``results.jsonl`` is written: add verdicts that depend on options
        outside the results' key (eval-lines: ``--scoring``), in place."""

    def finish(self, records: list[dict[str, Any]], ctx: Context, layout: Any) -> str:
        """Main process: write the summaries from the finished records (in case order); the text
        to print. OSError from a write is reported with its path."""
        raise NotImplementedError
