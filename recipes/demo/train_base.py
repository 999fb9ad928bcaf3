"""Retrain the CPU demo's base model and refresh ringft/assets/demo_base.

Not a test (~40 min on one CPU core): it runs the two stages in one process with one
thread each (recipes/demo/base_induction.yaml: induction warm-up on repeated random runs, then
recipes/demo/base.yaml: line retrieval at 128 tokens), evaluates line retrieval at the trained
length (128) and at 4x (512) on 2 processes, and copies the exported model (weights, config,
tokenizer, ``ringft_recipe.json``) into the assets folder. It prints the new weights' SHA-256;
tests/recipes/test_demo.py records the shipped one::

    python recipes/demo/train_base.py            # train, evaluate, install into ringft/assets
    python recipes/demo/train_base.py --dry-run  # print the commands only

The run is seeded (``train.seed``); the same machine and library versions give the same weights.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = ("recipes/demo/base_induction.yaml", "recipes/demo/base.yaml")
ASSETS = REPO / "ringft" / "assets" / "demo_base"
SHIPPED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "ringft_recipe.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(cmd: list[str], dry_run: bool) -> None:
    """Run ``cmd`` from the repo root with one thread per process (or print it), failing loudly."""
    print("+", " ".join(cmd), flush=True)
    if not dry_run:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=REPO, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, install; returns the process exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="outputs/demo_base", help="the training run's output_dir")
    p.add_argument("--no-install", action="store_true", help="do not copy the result into ringft/assets")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args(argv)
    launch = ["accelerate", "launch", "--config_file", "recipes/accelerate/cpu_2proc.yaml", "-m", "ringft"]
    start = time.perf_counter()
    warmup = f"{args.output}/induction"
    train = [sys.executable, "-m", "ringft", "train"]
    run([*train, STAGES[0], "--checkpoint.output_dir", warmup], args.dry_run)
    lines = f"{args.output}/lines"
    model = ["--model.name_or_path", f"{warmup}/final"]
    run([*train, STAGES[1], *model, "--checkpoint.output_dir", lines], args.dry_run)
    trained = time.perf_counter() - start
    final = f"{lines}/final"
    run(
        [
            *launch,
            "eval-lines",
            "--model",
            final,
            "--output",
            f"{args.output}/eval-lines",
            "--prompt-style",
            "ringft",
            "--lengths",
            "120,500",
            "--depths",
            "0,0.25,0.5,0.75,1",
            "--cases",
            "8",
            "--max-new-tokens",
            "8",
            "--dtype",
            "fp32",
            "--attn-backend",
            "torch",
            "--no-progress",
        ],
        args.dry_run,
    )
    if args.dry_run:
        return 0
    print(f"trained in {trained:.0f} s; eval summary: {args.output}/eval-lines/summary.csv")
    if not args.no_install:
        ASSETS.mkdir(parents=True, exist_ok=True)
        for name in SHIPPED_FILES:
            src = REPO / final / name
            if src.is_file():
                shutil.copy2(src, ASSETS / name)
        print(f"installed into {ASSETS.relative_to(REPO)}")
    print(f"model.safetensors sha256: {sha256(REPO / final / 'model.safetensors')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
