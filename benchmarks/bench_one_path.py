"""``ringft train`` before / after a change of its training stack: the same recipes, one run.

Each case is a recipe (a tiny LLaMA built from config on synthetic line-retrieval records, or the
shortened CPU demo) launched as a user launches it: ``accelerate launch --config_file
recipes/accelerate/cpu_2proc.yaml --num_processes N -m ringft train RECIPE.yaml``, gloo on CPU,
with ``logging.log_every 1`` so that ``metrics.jsonl`` holds every step. Per case it records the
per-step losses (fp32), the step time (global tokens per step / the logged ``tokens_per_s``; the
median over the steps after the first two) and the peak resident set of rank 0 (``peak_mem_gb``,
the process's ``ru_maxrss``), plus the launch's wall time.

``--repo DIR`` runs the ``ringft`` of another checkout (e.g. the commit before the change, unpacked
with ``git archive``); ``--compare BEFORE.json`` prints the differences against an earlier output:
the largest relative loss difference per case, and the step time / peak memory ratios.

Run: ``python benchmarks/bench_one_path.py --output after.json [--compare before.json]``
(about 5 minutes on 2 cores for every case).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.machine without installing

from benchmarks.machine import describe_machine  # noqa: E402

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def tiny_recipe(cp: int = 1, ulysses: int = 1, **extra: dict[str, Any]) -> dict[str, Any]:
    """A tiny fp32 LLaMA on 64 synthetic records of 256 tokens, 12 steps of AdamW with decay."""
    raw: dict[str, Any] = {
        "model": {
            "config": dict(TINY_MODEL),
            "model_type": "llama",
            "tokenizer": "demo",
            "dtype": "fp32",
            "attn_backend": "torch",
        },
        "data": {"synthetic": {"num_examples": 64, "questions": 2}, "seq_len": 256},
        "parallel": {"cp_size": cp, "ulysses_size": ulysses},
        "train": {
            "micro_batch_size": 2,
            "grad_accum": 2,
            "max_steps": 12,
            "lr": 2e-3,
            "warmup_steps": 2,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "gradient_checkpointing": False,
            "chunked_loss": False,
            "seed": 0,
        },
        "checkpoint": {"save_every": 0, "keep": 1, "save_final": False},
        "logging": {"tracker": "none", "log_every": 1},
    }
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values} if values is not None else None
    return raw


# name -> (processes, recipe mapping or a shipped recipe's path, overrides)
CASES: dict[str, tuple[int, Any, list[str]]] = {
    "demo": (
        2,
        "recipes/demo/extend.yaml",
        ["--train.max_steps", "30", "--checkpoint.save_final", "false", "--logging.log_every", "1"],
    ),
    "cp1": (1, tiny_recipe(cp=1), []),
    "cp2": (2, tiny_recipe(cp=2), []),
    "cp4": (4, tiny_recipe(cp=4), []),
    "dp2_cp2": (4, tiny_recipe(cp=2), []),
    "ulysses2_ring2": (4, tiny_recipe(cp=4, ulysses=2), []),
    "lora_cp2": (2, tiny_recipe(cp=2, lora={"r": 8, "alpha": 16}), []),
    "full_bf16_cp2": (2, tiny_recipe(cp=2, model={"dtype": "bf16"}), []),
    "memory_options_cp2": (
        2,
        tiny_recipe(
            cp=2,
            train={
                "gradient_checkpointing": True,
                "chunked_loss": True,
                "loss_chunk_size": 64,
                "tiled_mlp_tokens": 64,
                "tiled_norm_tokens": 64,
            },
        ),
        [],
    ),
    "lora_bf16_adapters_cp2": (
        2,
        tiny_recipe(cp=2, model={"dtype": "bf16"}, lora={"r": 8, "alpha": 16, "adapter_dtype": "model"}),
        [],
    ),
    "offload_cp2": (
        2,
        tiny_recipe(
            cp=2,
            train={
                "gradient_checkpointing": True,
                "offload_activations": True,
                "attention_checkpoint": "offload",
            },
        ),
        [],
    ),
}


def _tokens_per_step(recipe: dict[str, Any], processes: int) -> int:
    t, cp = recipe.get("train", {}), recipe.get("parallel", {}).get("cp_size", 1)
    dp = processes // cp
    return dp * t.get("micro_batch_size", 1) * t.get("grad_accum", 1) * recipe["data"]["seq_len"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def accelerate_launch(repo: Path, processes: int, port: int) -> list[str]:
    """The command line up to the program: ``accelerate launch`` of ``processes`` gloo processes on
    CPU with ``repo``'s launch config."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(repo / "recipes/accelerate/cpu_2proc.yaml"),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(port),
    ]


def run_case(name: str, repo: Path, work: Path, port: int, extra: list[str]) -> dict[str, Any]:
    """Launch one case with ``repo``'s ringft; its losses, step times and peak memory."""
    import yaml

    processes, recipe, overrides = CASES[name]
    work.mkdir(parents=True, exist_ok=True)
    if isinstance(recipe, str):
        recipe_path = repo / recipe
        raw = yaml.safe_load(recipe_path.read_text())
        for i in range(0, len(overrides), 2):  # the overrides this script uses: --section.key value
            section, key = overrides[i][2:].split(".")
            raw[section][key] = yaml.safe_load(overrides[i + 1])
    else:
        raw = recipe
        recipe_path = work / f"{name}-{port}.yaml"
        recipe_path.write_text(yaml.safe_dump(raw))
    out = work / f"{name}-{port}"
    cmd = [
        *accelerate_launch(repo, processes, port),
        "-m",
        "ringft",
        "train",
        str(recipe_path),
        "--checkpoint.output_dir",
        str(out),
        "--no-progress",
        *extra,
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    tic, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
    wall, cpu = time.perf_counter() - tic, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokens = _tokens_per_step(raw, processes)
    times = [tokens / r["tokens_per_s"] for r in rows]
    return {
        "processes": processes,
        "steps": [r["step"] for r in rows],
        "losses": [r["loss"] for r in rows],
        "step_s": times,
        "median_step_s": statistics.median(times[2:] or times),
        "peak_rss_gb": max(r["peak_mem_gb"] for r in rows),
        "wall_s": wall,
        "cpu_s": cpu,  # user + system time of every process of the launch (imports and set-up included)
    }


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Markdown table rows: per case, the worst relative loss difference and the ratios."""
    lines = [
        "| case | steps | max rel. loss diff | step time after / before | peak RSS after / before "
        "| launch CPU s after / before |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, a in after["cases"].items():
        b = before["cases"].get(name)
        if b is None:
            continue
        n = min(len(a["losses"]), len(b["losses"]))
        diff = max(abs(x - y) / abs(y) for x, y in zip(a["losses"][:n], b["losses"][:n]))
        lines.append(
            f"| {name} | {n} | {diff:.2e} | {a['median_step_s'] / b['median_step_s']:.3f} "
            f"({b['median_step_s'] * 1e3:.0f} -> {a['median_step_s'] * 1e3:.0f} ms) | "
            f"{a['peak_rss_gb'] / b['peak_rss_gb']:.3f} "
            f"({b['peak_rss_gb']:.3f} -> {a['peak_rss_gb']:.3f} GiB) | "
            + (f"{b['cpu_s']:.1f} -> {a['cpu_s']:.1f} |" if "cpu_s" in a and "cpu_s" in b else "- |")
        )
    return lines


def _summary(name: str, case: dict[str, Any]) -> str:
    return (
        f"{name}: loss {case['losses'][0]:.4f} -> {case['losses'][-1]:.4f}, "
        f"{case['median_step_s'] * 1e3:.0f} ms/step, peak {case['peak_rss_gb']:.3f} GiB, "
        f"{case['wall_s']:.0f} s"
    )


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of repeated runs (the same losses), the one of the lowest median step time (the least
    disturbed by other load on a shared machine); every run's median is kept."""
    best = dict(min(runs, key=lambda r: r["median_step_s"]))
    best["median_step_s_runs"] = [r["median_step_s"] for r in runs]
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose ringft runs")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    parser.add_argument("--output", type=Path, required=True, help="JSON written here")
    parser.add_argument("--compare", type=Path, help="an earlier output to compare with")
    parser.add_argument("--port", type=int, default=29641)
    parser.add_argument("--train-args", default="", help="more `ringft train` arguments, space-separated")
    parser.add_argument(
        "--before-repo",
        type=Path,
        help="also run this checkout, alternating with --repo case by case (one run); its JSON goes to "
        "--before-output and the comparison is printed",
    )
    parser.add_argument("--before-output", type=Path)
    parser.add_argument("--repeats", type=int, default=1, help="runs per case (and per checkout)")
    args = parser.parse_args(argv)
    sides = {"after": (args.repo.resolve(), args.train_args.split(), args.output)}
    if args.before_repo:
        sides = {"before": (args.before_repo.resolve(), [], args.before_output), **sides}
    results = {
        side: {
            "machine": describe_machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "repo": repo.name,
            "train_args": extra,
            "cases": {},
        }
        for side, (repo, extra, _) in sides.items()
    }
    port = args.port
    with tempfile.TemporaryDirectory(prefix="bench_one_path_") as tmp:
        for name in args.cases.split(","):
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            for _ in range(args.repeats):
                for side, (repo, extra, _) in sides.items():
                    port += 1
                    runs[side].append(run_case(name, repo, Path(tmp) / side, port, extra))
            for side, (_, _, output) in sides.items():
                results[side]["cases"][name] = _best(runs[side])
                print(f"[{side}] {_summary(name, results[side]['cases'][name])}", flush=True)
                if output:
                    output.write_text(json.dumps(results[side], indent=1))
    if args.before_repo:
        print("\n".join(compare(results["before"], results["after"])))
    elif args.compare:
        print("\n".join(compare(json.loads(args.compare.read_text()), results["after"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
