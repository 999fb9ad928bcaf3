"""``ringft eval-lines``: LongChat-style line retrieval at long context, run on the CP ring.

Launch like training (``accelerate launch ... -m ringft eval-lines ...``): world = dp x cp, each CP
group evaluates one case at a time: one prefill over the ring (no rank holds the whole sequence's
activations) serves both greedy generation with the distributed KV cache (exact, nothing
truncated, stops at EOS) and the teacher-forced probability of the answer; the DP groups split the
cases. Scoring (``--scoring``): LongChat's rule by default, the last integer of the output must equal
the stored number. Outputs in ``--output``: ``cases.jsonl`` (reusable with ``--cases-file``),
``results.jsonl`` (one line per case), ``summary.csv`` / ``summary.md`` (accuracy and mean answer
probability by length x depth), ``heatmap.png``. Re-running with the same ``--output`` and settings
skips finished cases (see :mod:`ringft.evals.store`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from typing import Any

import torch

from ringft.data.line_retrieval import PROMPT_STYLES, SCORING_RULES, LineCase, save_cases_jsonl, score_answer
from ringft.evals.checks import EvalInputError, check_positive
from ringft.evals.prepare import DEFAULT_CASES, DEFAULT_DEPTHS, DEFAULT_LENGTHS, EvalPlan, prepare
from ringft.evals.store import ResultsWriteError, case_key, write_error
from ringft.evals.summary import summarize
from ringft.ops import BACKENDS
from ringft.ops.validate import PeerFailed, run_together


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="ringft eval-lines", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder / hub name (or a LoRA adapter folder)")
    p.add_argument("--tokenizer", default=None, help="default: --model; 'demo' = the shipped demo tokenizer")
    p.add_argument("--lengths", default=None, help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS})")
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
    p.add_argument("--cp", type=int, default=None, help="CP group size (default: all processes)")
    p.add_argument("--output", default="outputs/eval-lines")
    p.add_argument("--max-new-tokens", type=int, default=100, help="generation budget (LongChat: 100)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (default auto)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rope-theta", type=float, default=None, help="override the model's RoPE theta")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


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


def _write_cases(plan: EvalPlan) -> None:
    plan.store.prepare()
    path = plan.store.folder / "cases.jsonl"
    try:
        save_cases_jsonl(plan.cases, path)
    except OSError as exc:
        raise write_error(path, exc) from None


def _finish(plan: EvalPlan, args: argparse.Namespace, layout: Any) -> list[dict[str, Any]]:
    """Main process, after every replica finished: merge, score, write results and summaries."""
    done, _ = plan.store.load()
    results = [done[case_key(c)] for c in plan.cases if case_key(c) in done]
    for record in results:
        record["correct"] = score_answer(record["generated"], record["answer"], args.scoring)
        record["scoring"] = args.scoring
    out_dir = plan.store.folder
    path = out_dir / "results.jsonl"
    try:
        with open(path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in results)
        path = out_dir / "summary.md"
        table = summarize(results, out_dir, args.scoring, args.max_new_tokens)
    except OSError as exc:
        raise write_error(getattr(exc, "filename", None) or path, exc) from None
    style = plan.cases[0].prompt_style
    print(
        f"\nline retrieval, {args.model} (dp={layout.dp_size} x cp={layout.cp_size}, prompt style "
        f"{style}, scoring {args.scoring}):\n{table}"
    )
    print(f"results in {out_dir}/ (results.jsonl, summary.csv, summary.md, heatmap.png)")
    return results


def run_eval(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Check inputs (no model loaded), then evaluate on the ring; the merged results (main process)
    or [] (other ranks). Every rank must call it with the same arguments."""
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from ringft.evals.model import load_eval_model
    from ringft.model.inference import RingInference
    from ringft.ops import dtype_from_name
    from ringft.ops.parallel import build_layout

    state = PartialState(cpu=not torch.cuda.is_available())
    cp = args.cp or state.num_processes

    def check() -> EvalPlan:
        if args.cp is not None:
            check_positive("--cp", args.cp, "process per CP group")
        if args.cp is not None and state.num_processes % args.cp:
            raise EvalInputError(
                f"--cp {args.cp} does not divide the {state.num_processes} processes: launch a "
                f"multiple of {args.cp} processes, or choose a --cp that divides {state.num_processes}"
            )
        if args.backend == "flash_attn" and state.device.type != "cuda":
            raise EvalInputError(
                f"--backend flash_attn needs CUDA GPUs, this run is on {state.device.type}: "
                "use --backend torch (or auto)"
            )
        return prepare(args)

    # Every bad input is found here, before any model loads; run_together() then stops every rank,
    # with the error named once, and also makes every rank finish reading --output before it is
    # written to. Each later step that can fail on one rank is run the same way.
    plan = run_together(check)
    layout = build_layout(cp, state.device.type)
    main_process = state.is_main_process
    if main_process:
        for line in [plan.warning, *plan.notes]:
            if line:
                print(f"ringft eval-lines: warning: {line}", file=sys.stderr)
    run_together(lambda: _write_cases(plan), here=main_process)

    dtype = dtype_from_name(args.dtype, allowed=("bf16", "fp32"))
    model = run_together(lambda: load_eval_model(args.model, dtype, state.device, args.rope_theta))
    engine = RingInference(model, layout.cp_group, args.backend)
    stop_ids = stop_token_ids(model, plan.tokenizer)

    todo = [c for c in plan.cases if case_key(c) not in plan.done]
    mine = todo[layout.dp_rank :: layout.dp_size]
    steps = -(-len(todo) // layout.dp_size)  # the same on every rank: run_together() once per step
    writer = layout.cp_rank == 0
    hide = args.no_progress or not main_process
    for step in tqdm(range(steps), desc=f"eval-lines dp{layout.dp_rank}", disable=hide, file=sys.stdout):
        record = None
        if step < len(mine):
            record = evaluate_case(engine, plan.tokenizer, mine[step], args.max_new_tokens, stop_ids)
        run_together(partial(plan.store.append, layout.dp_rank, record), here=writer and record is not None)
    # The main process writes the merged results; a failure there (disk full) stops every rank.
    return run_together(lambda: _finish(plan, args, layout), here=main_process) or []


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 on success, 2 on a bad input, 1 on a fault. Either is named once, by the
    lowest rank that met it; the other ranks stop with it, without waiting (see
    :func:`ringft.ops.validate.fail_together`)."""
    args = parse_args(argv)
    try:
        run_eval(args)
    except EvalInputError as exc:
        print(f"ringft eval-lines: error: {exc}", file=sys.stderr)
        return 2
    except PeerFailed as exc:
        return exc.exit_code
    except ResultsWriteError as exc:
        print(f"ringft eval-lines: error: {exc}", file=sys.stderr)
        return 1
    return 0
