"""``ringft eval-lines``: LongChat-style line retrieval at long context, run on the CP ring.

Launch like training (``accelerate launch ... -m ringft eval-lines ...``): world = dp x cp, each CP
group prefills one case at a time over the ring (no rank holds the whole sequence's activations),
then decodes greedily with the distributed KV cache (exact, nothing truncated); the DP groups
split the cases. Scoring: the *first* integer of the generated text must equal the stored number
(``score_answer``); we also report the teacher-forced probability of the answer tokens.
Outputs in ``--output``: ``cases.jsonl`` (the generated tests, reusable with ``--cases-file``),
``results.jsonl`` (one line per case), ``summary.csv`` / ``summary.md`` (accuracy by length x
depth) and ``heatmap.png``. Re-running with the same ``--output`` skips finished cases.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringft.lines import (
    LineCase,
    load_cases_jsonl,
    make_line_cases,
    save_cases_jsonl,
    score_answer,
)


def case_key(case: LineCase) -> str:
    return f"{case.length}|{case.depth}|{case.case_index}|{case.seed}"


def load_eval_model(path: str, dtype: torch.dtype, device: torch.device):
    """A full model, or a LoRA adapter folder (merged onto its base model) from a path or hub name."""
    from transformers import AutoModelForCausalLM

    if Path(path, "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel
        from transformers import AutoConfig

        base_name = PeftConfig.from_pretrained(path).base_model_name_or_path
        # ringft's trainer saves the base config with the run's RoPE overrides next to the adapter.
        config = AutoConfig.from_pretrained(path if Path(path, "config.json").is_file() else base_name)
        base = AutoModelForCausalLM.from_pretrained(base_name, config=config, dtype=dtype)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device)


def answer_token_ids(tokenizer, case: LineCase) -> list[int]:
    """The answer as the model would continue the prompt (a leading space after raw prompts)."""
    text = case.answer if case.chat_template else " " + case.answer
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def evaluate_case(engine, tokenizer, case: LineCase, max_new_tokens: int) -> dict[str, Any]:
    prompt_ids = case.input_ids(tokenizer)
    generated = engine.generate(prompt_ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    logprob, argmax_ok = engine.answer_logprob(prompt_ids, answer_token_ids(tokenizer, case))
    return {
        "key": case_key(case),
        "length": case.length,
        "depth": case.depth,
        "case_index": case.case_index,
        "num_tokens": len(prompt_ids),
        "answer": case.answer,
        "target_line": case.target_line,
        "generated": text,
        "correct": score_answer(text, case.answer),
        "answer_prob": math.exp(logprob),
        "teacher_forced_correct": argmax_ok,
    }


def summarize(results: list[dict[str, Any]], out_dir: Path) -> str:
    """Write summary.csv / summary.md / heatmap.png; return the Markdown table."""
    cells: dict[tuple[int, float], list[dict]] = defaultdict(list)
    for r in results:
        cells[(r["length"], r["depth"])].append(r)
    lengths = sorted({k[0] for k in cells})
    depths = sorted({k[1] for k in cells})

    def acc(rs):
        return sum(r["correct"] for r in rs) / len(rs) if rs else float("nan")

    with open(out_dir / "summary.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            ["length", "depth", "cases", "accuracy", "mean_answer_prob", "teacher_forced_accuracy"]
        )
        for (length, depth), rs in sorted(cells.items()):
            writer.writerow(
                [
                    length,
                    depth,
                    len(rs),
                    f"{acc(rs):.4f}",
                    f"{sum(r['answer_prob'] for r in rs) / len(rs):.4f}",
                    f"{sum(r['teacher_forced_correct'] for r in rs) / len(rs):.4f}",
                ]
            )
    header = "| length \\ depth | " + " | ".join(f"{d:.0%}" for d in depths) + " | all |"
    lines = [header, "|" + "---|" * (len(depths) + 2)]
    for length in lengths:
        row = [acc(cells.get((length, d), [])) for d in depths]
        all_rs = [r for d in depths for r in cells.get((length, d), [])]
        lines.append(f"| {length} | " + " | ".join(f"{a:.2f}" for a in row) + f" | {acc(all_rs):.2f} |")
    overall = acc(results)
    lines.append(
        f"\nOverall accuracy: {overall:.3f} over {len(results)} cases "
        f"(greedy generation, first integer must equal the stored number)."
    )
    table = "\n".join(lines)
    (out_dir / "summary.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        grid = [[acc(cells.get((length, d), [])) for d in depths] for length in lengths]
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(depths), 1.0 + 0.6 * len(lengths)))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("depth of the asked line")
        ax.set_ylabel("prompt tokens")
        ax.set_title("line retrieval accuracy")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out_dir / "heatmap.png", dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        pass
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringft eval-lines", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder / hub name (or a LoRA adapter folder)")
    p.add_argument("--tokenizer", default=None, help="default: --model; 'demo' = the shipped demo tokenizer")
    p.add_argument("--lengths", default="4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="depths of the asked line in [0, 1]")
    p.add_argument("--cases", type=int, default=5, help="cases per (length, depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases-file", default=None, help="evaluate these cases (jsonl) instead of generating")
    p.add_argument("--cp", type=int, default=None, help="CP group size (default: all processes)")
    p.add_argument("--output", default="outputs/eval-lines")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rope-theta", type=float, default=None, help="override the model's RoPE theta")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run_eval(args: argparse.Namespace) -> list[dict[str, Any]]:
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from ringft.demo_tokenizer import load_tokenizer
    from ringft.inference import RingInference
    from ringft.parallel import build_layout

    state = PartialState(cpu=not torch.cuda.is_available())
    world = state.num_processes
    cp = args.cp or world
    layout = build_layout(cp, state.device.type)
    out_dir = Path(args.output)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if args.cases_file:
        cases = load_cases_jsonl(args.cases_file)
    else:
        lengths = [int(x) for x in args.lengths.split(",")]
        depths = [float(x) for x in args.depths.split(",")]
        cases = make_line_cases(tokenizer, lengths, depths, args.cases, args.seed)
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_cases_jsonl(cases, out_dir / "cases.jsonl")
    state.wait_for_everyone()
    # Resumable: every replica appends to its own file; finished cases are skipped.
    done: dict[str, dict] = {}
    for f in sorted(out_dir.glob("results-dp*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["key"]] = rec
    todo = [c for c in cases if case_key(c) not in done]
    mine = todo[layout.dp_rank :: layout.dp_size]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_eval_model(args.model, dtype, state.device)
    if args.rope_theta is not None:
        raise SystemExit("--rope-theta: set rope_parameters in the model's config.json instead")
    engine = RingInference(model, layout.cp_group, args.backend)
    writer = layout.cp_rank == 0
    path = out_dir / f"results-dp{layout.dp_rank}.jsonl"
    bar = tqdm(
        mine,
        desc=f"eval-lines dp{layout.dp_rank}",
        disable=args.no_progress or not state.is_main_process,
        file=sys.stdout,
    )
    for case in bar:
        rec = evaluate_case(engine, tokenizer, case, args.max_new_tokens)
        if writer:
            with open(path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        done[rec["key"]] = rec
    state.wait_for_everyone()
    results: list[dict[str, Any]] = []
    for f in sorted(out_dir.glob("results-dp*.jsonl")):
        results += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    wanted = {case_key(c) for c in cases}
    results = sorted(
        {r["key"]: r for r in results if r["key"] in wanted}.values(),
        key=lambda r: (r["length"], r["depth"], r["case_index"]),
    )
    if state.is_main_process:
        with open(out_dir / "results.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in results)
        table = summarize(results, out_dir)
        print(f"\nline retrieval, {args.model} (dp={layout.dp_size} x cp={layout.cp_size}):\n{table}")
        print(f"results in {out_dir}/ (results.jsonl, summary.csv, summary.md, heatmap.png)")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run_eval(args)
    except ValueError as exc:
        print(f"ringft eval-lines: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.barrier()
    return 0
