"""The evaluation harness every ``ringft eval-*`` command runs on: tasks plug into it.

One run: parse the common options (:func:`add_common_arguments`), check every input and build the
task's cases with no model loaded (:func:`ringft.evals.prepare.prepare_run`; a bad input is one
line, exit 2, on every rank, nothing written), then evaluate the cases that the results in
``--output`` do not already hold, on the CP ring: every CP group takes one case at a time (one ring
prefill per case: :class:`ringft.model.inference.RingInference`), the DP replicas split the cases,
each finished case is appended durably to ``results-dp<k>.jsonl`` (:mod:`ringft.evals.store`),
with a progress bar, and the main process writes the merged ``results.jsonl`` and the task's
summaries. Every rank must call :func:`run_task` with the same arguments; a failure on any rank
(a full disk) ends every rank, named once.

A task is a :class:`ringft.evals.task.EvalTask`: its typed options, the cases it evaluates (built
before any model loads), each case's key, the models a case needs (``roles``: the harness loads each
group of cases' models once), how one case is evaluated (``evaluate``, given a
:class:`ringft.evals.task.Runner`), and its summaries (``finish``).
"""

from __future__ import annotations

import argparse
import gc
import sys
from functools import partial
from typing import Any

import torch

from ringft.evals.checks import EvalInputError
from ringft.evals.store import ResultsWriteError
from ringft.evals.task import EvalTask, ModelLoader, ModelRef, Runner
from ringft.ops import BACKENDS, dtype_from_name
from ringft.ops.helptext import plain
from ringft.ops.validate import PeerFailed, run_together
from ringft.utils.options import add_option


def add_common_arguments(parser: argparse.ArgumentParser, task: EvalTask) -> None:
    """The options every eval command takes: model, tokenizer, layout, dtype, output, progress."""
    parser.add_argument("--model", required=True, help="model folder / hub name (or a LoRA adapter folder)")
    parser.add_argument(
        "--tokenizer", default=None, help="default: --model; 'demo' = the shipped demo tokenizer"
    )
    add_option(parser, "cp_size", note="default: all processes")
    parser.add_argument("--output", default=task.default_output)
    add_option(parser, "attn_backend", default="auto", choices=BACKENDS)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rope-theta", type=float, default=None, help="override the model's RoPE theta")
    parser.add_argument("--no-progress", action="store_true")


def parse_task_args(task: EvalTask, argv: list[str] | None) -> argparse.Namespace:
    """The command line of ``ringft <task.command>``; ``--help`` shows the task module's docstring."""
    parser = argparse.ArgumentParser(
        prog=f"ringft {task.command}",
        description=plain(sys.modules[type(task).__module__].__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_arguments(parser, task)
    task.add_arguments(parser)
    return parser.parse_args(argv)


def stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Token ids that end generation: the tokenizer's EOS and the model's generation_config EOS
    (chat models often end their turn with a token of their own), sorted."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return sorted(ids)


def role_groups(task: EvalTask, cases: list[Any]) -> list[tuple[tuple[str, ...], list[Any]]]:
    """Runs of consecutive cases needing the same models, in case order."""
    groups: list[tuple[tuple[str, ...], list[Any]]] = []
    for case in cases:
        roles = task.roles(case)
        if groups and groups[-1][0] == roles:
            groups[-1][1].append(case)
        else:
            groups.append((roles, [case]))
    return groups


class _Models:
    """The loaded models by role (each wrapped in a ring engine); :meth:`need` loads what a group of
    cases runs on, every rank together, and frees the models it no longer needs."""

    def __init__(
        self, refs: list[ModelRef], load: ModelLoader, dtype: torch.dtype, device: Any, group, backend
    ):
        self.refs = {ref.role: ref for ref in refs}
        self.load, self.dtype, self.device, self.group, self.backend = load, dtype, device, group, backend
        self.engines: dict[str, Any] = {}
        self.stop_ids: dict[str, list[int]] = {}

    def need(self, roles: tuple[str, ...], tokenizer: Any) -> None:
        from ringft.model.inference import RingInference

        for role in [r for r in self.engines if r not in roles]:
            del self.engines[role]
            gc.collect()
        for role in roles:
            if role not in self.engines:
                ref = self.refs[role]
                model = run_together(lambda r=ref: self.load(r.path, self.dtype, self.device, r.rope_theta))
                self.engines[role] = RingInference(model, self.group, self.backend)
                self.stop_ids[role] = stop_token_ids(model, tokenizer)


def run_task(task: EvalTask, args: argparse.Namespace, load_model: ModelLoader | None = None) -> list[dict]:
    """Check inputs (no model loaded), then evaluate the unfinished cases on the ring; the merged
    records (main process) or [] (other ranks). Every rank must call it with the same arguments."""
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from ringft.evals.model import load_eval_model
    from ringft.evals.prepare import check_layout, prepare_run
    from ringft.ops.parallel import build_layout

    state = PartialState(cpu=not torch.cuda.is_available())
    prog = f"ringft {task.command}"

    def check():
        check_layout(args, state.num_processes, state.device.type)
        return prepare_run(task, args, state.num_processes, state.is_main_process)

    # Every bad input is found here, before any model loads; every rank stops with it, named once,
    # and every rank finishes reading --output before the main process writes to it.
    plan = run_together(check)
    opts = plan.ctx.options
    layout = build_layout(opts.cp_size or state.num_processes, device_type=state.device.type)
    main_process = state.is_main_process
    if main_process:
        for line in [plan.warning, *plan.notes]:
            if line:
                print(f"{prog}: warning: {line}", file=sys.stderr)
    run_together(plan.start, here=main_process)

    dtype = dtype_from_name(opts.dtype, allowed=("bf16", "fp32"))
    load = load_model or load_eval_model
    models = _Models(task.models(opts), load, dtype, state.device, layout.cp_group, opts.attn_backend)
    writer = layout.cp_rank == 0
    hide = opts.no_progress or not main_process
    for roles, group in role_groups(task, plan.cases):
        todo = [c for c in group if task.key(c) not in plan.done]
        if not todo:
            continue
        models.need(roles, plan.ctx.tokenizer)
        runner = Runner(models.engines, plan.ctx.tokenizer, models.stop_ids, task.runner_extra(opts))
        mine = todo[layout.dp_rank :: layout.dp_size]
        steps = -(-len(todo) // layout.dp_size)  # the same on every rank: one agreement per step
        desc = f"{task.command} {'+'.join(roles)} dp{layout.dp_rank}"
        for step in tqdm(range(steps), desc=desc, disable=hide, file=sys.stdout):
            record = task.evaluate(runner, mine[step]) if step < len(mine) else None
            run_together(
                partial(plan.store.append, layout.dp_rank, record), here=writer and record is not None
            )
    models.engines.clear()
    # The main process writes the merged results; a failure there (disk full) stops every rank.
    return run_together(lambda: plan.finish(task, layout), here=main_process) or []


def task_main(task: EvalTask, argv: list[str] | None = None, load_model: ModelLoader | None = None) -> int:
    """Entry point of ``ringft <task.command>``: 0 on success, 2 on a bad input, 1 on a fault.
    Either is named once, by the lowest rank that met it; the other ranks stop with it."""
    args = parse_task_args(task, argv)
    try:
        run_task(task, args, load_model)
    except EvalInputError as exc:
        print(f"ringft {task.command}: error: {exc}", file=sys.stderr)
        return 2
    except PeerFailed as exc:
        return exc.exit_code
    except ResultsWriteError as exc:
        print(f"ringft {task.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0
