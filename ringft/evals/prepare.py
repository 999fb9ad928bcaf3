"""Everything an eval run does before a model loads, for every task: check the common options, load
the tokenizer and each model's config (no weights), build the task's cases, open the resumable
results (:class:`PreparedRun`); and, after the run, merge the results and write the summaries.

Reads only until :meth:`PreparedRun.start`; each bad input raises
:class:`ringft.evals.checks.EvalInputError` (one line naming the value and the fix).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringft.data.tokenizer import load_tokenizer
from ringft.evals.checks import EvalInputError, check_positive, check_vocabulary
from ringft.evals.model import check_model_path, load_config, weights_identity
from ringft.evals.store import ResultsError, ResultsStore, tokenizer_identity, write_error
from ringft.evals.task import Context, EvalTask
from ringft.utils.values import as_number


def check_layout(args: argparse.Namespace, processes: int, device_type: str) -> None:
    """``--cp-size`` against the launched processes, ``--attn-backend flash_attn`` against the device."""
    if args.cp_size is not None:
        check_positive("--cp-size", args.cp_size, "process per CP group")
        if processes % args.cp_size:
            raise EvalInputError(
                f"--cp-size {args.cp_size} does not divide the {processes} processes: launch a multiple of "
                f"{args.cp_size} processes, or choose a --cp-size that divides {processes}"
            )
    if args.attn_backend == "flash_attn" and device_type != "cuda":
        raise EvalInputError(
            f"--attn-backend flash_attn needs CUDA GPUs, this run is on {device_type}: "
            "use --attn-backend torch (or auto)"
        )


def load_tokenizer_for(name: str) -> Any:
    """The tokenizer named by ``--tokenizer`` (or ``--model``); 'demo' is the shipped demo tokenizer."""

    if name not in ("demo", "demo-lines"):
        check_model_path(name)  # the same "no such folder" rule as --model
    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvalInputError(f"--tokenizer {name}: cannot load a tokenizer from it ({reason})") from None


def _config(path: str, rope_theta: float | None, flag: str) -> Any:
    check_model_path(path, flag)
    try:
        return load_config(path, rope_theta, flag)
    except EvalInputError:
        raise
    except ValueError as exc:  # a config without RoPE parameters to override
        raise EvalInputError(str(exc)) from None


def settings_of(task: EvalTask, opts: Any, tokenizer: Any) -> dict[str, Any]:
    """What the results depend on (see :mod:`ringft.evals.store`), as a JSON mapping: each model's
    path and weight files (a second model's keys are prefixed with its role), the tokenizer, the
    dtype, the RoPE theta override and the task's own settings."""
    settings: dict[str, Any] = {}
    for ref in task.models(opts):
        prefix = "" if ref.role == "model" else f"{ref.role}_"
        local = Path(ref.path).expanduser()
        settings[prefix + "model"] = str(local.resolve()) if local.exists() else ref.path
        settings[prefix + "weights"] = weights_identity(ref.path)
        if ref.role == "model" or ref.rope_theta is not None:
            settings[prefix + "rope_theta"] = ref.rope_theta
    settings["tokenizer"] = tokenizer_identity(tokenizer)
    settings["dtype"] = opts.dtype
    settings.update(task.settings(opts))
    return settings


@dataclass
class PreparedRun:
    """The checked inputs of one run: the task's context, its cases, the results store, the
    finished records by case key, notes about repaired results files and a warning."""

    ctx: Context
    cases: list[Any]
    store: ResultsStore
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warning: str | None = None
    task: EvalTask | None = None

    def start(self) -> None:
        """Main process, before any case: create ``--output``, write ``settings.json``, repair
        cut-off lines, and let the task save its cases."""
        self.store.prepare()
        try:
            self.task.save_cases(self.cases, self.store.folder)
        except OSError as exc:
            raise write_error(Path(getattr(exc, "filename", None) or self.store.folder), exc) from None

    def finish(self, task: EvalTask, layout: Any) -> list[dict[str, Any]]:
        """Main process, after every replica finished: merge the records in case order, write
        ``results.jsonl`` and the task's summaries, print the summary."""
        done, _ = self.store.load()
        records = [done[task.key(c)] for c in self.cases if task.key(c) in done]
        task.score(records, self.ctx)
        path = self.store.folder / "results.jsonl"
        try:
            with open(path, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in records)
            path = self.store.folder
            text = task.finish(records, self.ctx, layout)
        except OSError as exc:
            raise write_error(Path(getattr(exc, "filename", None) or path), exc) from None
        print(text)
        return records


def prepare_run(
    task: EvalTask, args: argparse.Namespace, processes: int = 1, main: bool = True
) -> PreparedRun:
    """Check every input and read what the run needs, in the order a user would fix them; nothing
    is written and no model weights are read. EvalInputError on the first bad input."""
    fix = "give a positive RoPE base, e.g. 1e6"
    as_number("--rope-theta", args.rope_theta, gt=0, optional=True, fix=fix, error=EvalInputError)
    if args.cp_size is not None:
        check_positive("--cp-size", args.cp_size, "process per CP group")
    opts = task.options(args)
    refs = task.models(opts)
    check_model_path(opts.model)
    tokenizer = load_tokenizer_for(opts.tokenizer or opts.model)
    configs = {}
    for ref in refs:
        flag = "--model" if ref.role == "model" else f"--{ref.role}"
        configs[ref.role] = _config(ref.path, ref.rope_theta, flag)
        check_vocabulary(tokenizer, configs[ref.role], flag)
    ctx = Context(opts, tokenizer, configs, processes, main)
    cases = task.cases(ctx)
    store = ResultsStore(opts.output, settings_of(task, opts, tokenizer))
    try:
        done, notes = store.load()
    except ResultsError as exc:
        raise EvalInputError(str(exc)) from None
    return PreparedRun(ctx, cases, store, done, notes, task.warning(ctx, cases), task)
