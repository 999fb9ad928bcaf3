"""Peak RSS of one ``ringft train`` launch, two checkouts alternating (before / after a change).

Each run is ``accelerate launch --config_file CONFIG -m ringft train RECIPE [overrides]`` inside the
checkout (its ``ringft`` first on ``PYTHONPATH``), wrapped in a fresh Python process that reports
``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the peak RSS of the largest process of that launch (a
rank). Runs alternate before / after ``--repeats`` times so that drifts of a shared machine fall on
both. Prints one line per run and the ratio range::

    python benchmarks/bench_peak_rss.py --before-repo ../old --repeats 2 \\
        --recipe recipes/demo/extend.yaml -- --train.max_steps 60
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_WRAPPER = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
    "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)"
)


def peak_rss_mib(repo: Path, config: str, recipe: str, overrides: list[str], out: Path) -> tuple[float, str]:
    """``(peak RSS in MiB of the largest process, the run's summary line)`` of one launch in ``repo``."""
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    launch = ["accelerate", "launch", "--config_file", config, "-m", "ringft", "train", recipe]
    args = [*launch, "--checkpoint.output_dir", str(out), "--no-progress", *overrides]
    done = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *args], cwd=repo, env=env, capture_output=True, text=True
    )
    match = re.search(r"^peak_kib (\d+) (-?\d+)$", done.stdout, re.M)
    if match is None or match.group(2) != "0":
        tail = done.stdout[-2000:] + done.stderr[-2000:]
        raise SystemExit(f"bench_peak_rss: the run in {repo} failed:\n{tail}")
    summary = next((line for line in done.stdout.splitlines() if line.startswith("ringft:")), "")
    return int(match.group(1)) / 1024, summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-repo", required=True, help="checkout of the version before the change")
    parser.add_argument("--after-repo", default=".", help="checkout of the version after (default: here)")
    parser.add_argument("--recipe", default="recipes/demo/extend.yaml", help="recipe, inside each checkout")
    parser.add_argument("--config", default="recipes/accelerate/cpu_2proc.yaml", help="accelerate config")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="recipe overrides after --, e.g. --train.max_steps 60")
    args = parser.parse_args(argv)
    repos = {"before": Path(args.before_repo).resolve(), "after": Path(args.after_repo).resolve()}
    peaks: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.repeats):
            for which, repo in repos.items():
                out = Path(tmp) / f"{which}-{run}"
                peak, summary = peak_rss_mib(repo, args.config, args.recipe, args.overrides, out)
                peaks[which].append(peak)
                print(f"{which} run {run + 1}: peak {peak:.0f} MiB  {summary}", flush=True)
    ratios = [a / b for a, b in zip(peaks["after"], peaks["before"])]
    print(f"after / before, pairwise: {', '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
