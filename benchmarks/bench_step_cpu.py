"""Per-step CPU time of ``ringft train``'s two engines (``--engine trainer`` vs ``--engine loop``),
LoRA on a bf16 model with bf16 adapters (fp32 masters) or fp32 adapters, at cp 1 and cp 2.

Each run is a launch as a user launches it (``accelerate launch --config_file
recipes/accelerate/cpu_2proc.yaml --num_processes CP``, gloo on CPU) of the tiny LLaMA recipe of
``bench_one_path.py`` with ``lora: {r: 8, alpha: 16, adapter_dtype: ...}``. Every process registers
a global optimizer step post hook (``torch.optim.optimizer.register_optimizer_step_post_hook``,
engine-agnostic) that records the process's CPU time (``time.process_time``: user + system, all its
threads) at the end of each optimizer step; a step's CPU time is the difference between consecutive
ends (data loading, forward, backward, clipping, step, logging: everything a step costs), the median
over the steps after the first two, mean over the ranks. CPU time rather than wall time: it is
what a step costs, barely moved by other load on a shared machine.

The engines alternate run by run (A/B/A/B, ``--repeats`` pairs per case; with ``--before-repo`` a
third run, the trainer of another checkout, joins each round); the summary is, per pair, the ratio
trainer / loop of the median step CPU time, of its 25th percentile (the least disturbed steps) and
of the median step wall time, and the median of each over the pairs. On a shared machine the
ratios of one pair scatter by +-15 % (two runs of the same engine included): use several repeats.

Run: ``python benchmarks/bench_step_cpu.py --output step_cpu.json`` (about 2 minutes per pair of
runs on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

ADAPTERS = {"bf16": "model", "fp32": "fp32"}


def _worker(out: str, argv: list[str]) -> int:
    """One rank of a launch: record the CPU time at each optimizer step's end, run ``ringft``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ringft.cli import main as ringft_main

    ends: list[tuple[float, float]] = []
    rank = os.environ.get("RANK", "0")
    profiler = _Profiler(os.environ.get("BENCH_STEP_PROFILE"), f"{out}.{rank}") if rank == "0" else None

    def step_end(*_: Any) -> None:
        ends.append((time.process_time(), time.perf_counter()))
        if profiler is not None:
            profiler.step(len(ends))

    register_optimizer_step_post_hook(step_end)
    try:
        code = ringft_main(argv)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return code
    finally:
        import ringft

        Path(f"{out}.{rank}").write_text(json.dumps({"ringft": ringft.__file__, "ends": ends}))


class _Profiler:
    """Rank 0's profile of optimizer steps ``FIRST + 1 .. FIRST + STEPS`` (``BENCH_STEP_PROFILE=
    cprofile`` or ``torch``): pstats / a table of aten ops and their counts, written beside the times."""

    FIRST, STEPS = 4, 10

    def __init__(self, kind: str | None, out: str):
        self.kind, self.out, self.prof = kind, out, None

    def step(self, done: int) -> None:
        if self.kind == "cprofile" and done == self.FIRST:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        elif self.kind == "torch" and done == self.FIRST:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        elif self.prof is not None and done == self.FIRST + self.STEPS:
            if self.kind == "cprofile":
                self.prof.disable()
                self.prof.dump_stats(f"{self.out}.pstats")
            else:
                self.prof.__exit__(None, None, None)
                table = self.prof.key_averages().table(sort_by="count", row_limit=400)
                Path(f"{self.out}.ops.txt").write_text(table)
            self.prof = None


def recipe(cp: int, adapters: str, steps: int) -> dict[str, Any]:
    from benchmarks.bench_one_path import tiny_recipe

    raw = tiny_recipe(
        cp=cp, model={"dtype": "bf16"}, lora={"r": 8, "alpha": 16, "adapter_dtype": ADAPTERS[adapters]}
    )
    raw["train"]["max_steps"] = steps
    return raw


def run_one(
    side: str, repo: Path, cp: int, adapters: str, steps: int, work: Path, port: int
) -> dict[str, Any]:
    """One launch of ``side`` (an engine, or ``trainer_before``: the trainer of ``repo``); per rank
    the CPU and wall seconds of each optimizer step."""
    import yaml

    from benchmarks.bench_one_path import accelerate_launch

    tag = f"{side}-cp{cp}-{adapters}-{port}"
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(recipe(cp, adapters, steps)))
    out = work / tag
    cmd = [
        *accelerate_launch(repo, cp, port),
        __file__,
        "--worker",
        str(out),
        "train",
        str(path),
        "--engine",
        "loop" if side == "loop" else "trainer",
        "--checkpoint.output_dir",
        str(out),
        "--no-progress",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    for _ in range(2):  # once more after a failed launch (gloo's rare abort at process exit)
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode == 0:
            break
        shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    cpu, wall = [], []
    for rank in range(cp):
        record = json.loads(Path(f"{out}.{rank}").read_text())
        if not record["ringft"].startswith(str(repo)):
            raise RuntimeError(f"{tag} ran the ringft of {record['ringft']}, not of {repo}")
        ends = record["ends"]
        cpu.append([b[0] - a[0] for a, b in zip(ends, ends[1:])])
        wall.append([b[1] - a[1] for a, b in zip(ends, ends[1:])])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {
        "step_cpu_s": cpu,
        "step_wall_s": wall,
        "median_step_cpu_s": statistics.mean(statistics.median(s[2:]) for s in cpu),
        "p25_step_cpu_s": statistics.mean(statistics.quantiles(s[2:], n=4)[0] for s in cpu),
        "median_step_wall_s": statistics.mean(statistics.median(s[2:]) for s in wall),
        "losses": [r["loss"] for r in rows],
    }


def _ratios(side: list[dict[str, Any]], loop: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per pair of runs, side / loop of: the median CPU, the 25th percentile CPU, the median wall time."""
    keys = {"cpu_median": "median_step_cpu_s", "cpu_p25": "p25_step_cpu_s"}
    keys["wall_median"] = "median_step_wall_s"
    return {k: [a[key] / b[key] for a, b in zip(side, loop)] for k, key in keys.items()}


def _summary(side: str, case: dict[str, Any]) -> str:
    ratios = case[f"{side}_over_loop"]
    parts = [
        f"{k} {statistics.median(v):.3f} ({', '.join(f'{r:.3f}' for r in v)})" for k, v in ratios.items()
    ]
    loop_ms = statistics.median(r["median_step_cpu_s"] for r in case["runs"]["loop"]) * 1e3
    same = case[f"{side}_losses_identical"]
    return f"{side} / loop: {'; '.join(parts)}; loop {loop_ms:.1f} CPU ms/step; losses identical: {same}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # ringft from PYTHONPATH: the checkout being measured
        return _worker(argv[1], argv[2:])
    sys.path.insert(0, str(REPO))  # benchmarks.* without installing
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", default="1,2", help="comma-separated CP sizes (one process per rank)")
    parser.add_argument("--adapters", default="bf16,fp32", help="comma-separated of bf16, fp32")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="trainer / loop pairs per case")
    parser.add_argument("--output", type=Path, required=True, help="JSON written here")
    parser.add_argument("--port", type=int, default=29741)
    parser.add_argument(
        "--profile",
        choices=("cprofile", "torch"),
        help="also profile rank 0 over 10 steps of each run; the profiles go to --work",
    )
    parser.add_argument(
        "--before-repo",
        type=Path,
        help="also run the trainer of this checkout (e.g. `git archive` of the commit before a change), "
        "interleaved with the others",
    )
    parser.add_argument("--work", type=Path, help="keep the runs' folders here (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.profile:
        os.environ["BENCH_STEP_PROFILE"] = args.profile
    from benchmarks.machine import describe_machine

    result: dict[str, Any] = {
        "machine": describe_machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cases": {},
    }
    sides = {"trainer": REPO, "loop": REPO}
    if args.before_repo:
        sides["trainer_before"] = args.before_repo.resolve()
    port = args.port
    with tempfile.TemporaryDirectory(prefix="bench_step_cpu_") as tmp:
        if args.work:
            args.work.mkdir(parents=True, exist_ok=True)
            tmp = str(args.work)
        for cp in (int(c) for c in args.cp.split(",")):
            for adapters in args.adapters.split(","):
                name = f"cp{cp}_{adapters}_adapters"
                runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
                for _ in range(args.repeats):
                    for side, repo in sides.items():
                        port += 1
                        runs[side].append(run_one(side, repo, cp, adapters, args.steps, Path(tmp), port))
                case: dict[str, Any] = {"runs": runs}
                for side in sides:
                    if side != "loop":
                        case[f"{side}_over_loop"] = _ratios(runs[side], runs["loop"])
                        same = runs[side][0]["losses"] == runs["loop"][0]["losses"]
                        case[f"{side}_losses_identical"] = same
                        print(f"{name}: {_summary(side, case)}", flush=True)
                result["cases"][name] = case
                args.output.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
