"""recipes/trl_dpo/run_cpu.sh and recipes/trl_grpo/run_cpu.sh (2 CPU processes, cp 2,
SmolLM2-135M-Instruct's real weights, LoRA: the reference model is the adapter disabled) against
their one-process command (``ONE_PROCESS=1``: TRL's trainer unchanged), both run at once:
every logged DPO / GRPO metric, step by step.

Tolerance: the logged values are fp32 sums over at most 2 x 2 sequences of ~60 tokens, each token
a log-softmax over SmolLM2's 49152-token vocabulary; LOSS_RTOL's derivation (tests/train/hf_runs.py)
with this vocabulary gives (4 * 64 + 49152) * eps32 = 5.9e-3 relative, far above what the ring
changes (~1e-6 observed) and far below what a sum over one shard (x 0.5) or a metric gathered
over every rank (num_tokens x 2) would.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ringft.utils.spawn import free_port, run_distributed
from tests.train.hf_runs import EPS32
from tests.train.launch_env import launch_env

REPO = Path(__file__).resolve().parents[2]
RTOL = (4 * 64 + 49152) * EPS32
KEYS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/accuracies", "entropy", "num_tokens")


def _logs(out: Path) -> list[dict]:
    return [h for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]


def _oracle(rank: int, world: int, script: str, argv: list[str]) -> None:
    """The recipe's one-process command, in a fork-server rank (TRL already imported there): the
    script's ``main(argv)`` with no process group, as ``python script argv`` runs it."""
    import importlib.util
    import os

    import torch.distributed as dist

    dist.destroy_process_group()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    spec = importlib.util.spec_from_file_location("recipe_script", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    module.main(argv)


def _run_both(recipe: str, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """recipes/<recipe>/run_cpu.sh as the ring (2 processes, launched) and, at the same time, its
    one-process command (``ONE_PROCESS=1``: its arguments as the launcher prints them with
    ``DRY_RUN=1``, run in a fork-server rank); their logs."""
    from tests.real_model import smollm2_path

    accelerate = str(Path(sys.executable).parent / "accelerate")
    base = dict(MODEL=str(smollm2_path()), PYTHON=sys.executable, ACCELERATE=accelerate)
    launcher = ["bash", str(REPO / "recipes" / recipe / "run_cpu.sh")]
    one = dict(base, ONE_PROCESS="1", DRY_RUN="1", OUTPUT_DIR=str(tmp_path / "one"))
    line = subprocess.run(launcher, env=launch_env(**one), capture_output=True, text=True, check=True)
    words = shlex.split(line.stdout.strip().splitlines()[-1])
    script = next(w for w in words if w.endswith(".py") and "/recipes/" in f"/{w}")
    ring_env = dict(base, OUTPUT_DIR=str(tmp_path / "ring"), LAUNCH_ARGS=f"--main_process_port {free_port()}")
    ring = subprocess.Popen(
        launcher, env=launch_env(**ring_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        run_distributed(_oracle, 1, str(REPO / script), words[words.index(script) + 1 :], timeout=420.0)
        out, err = ring.communicate(timeout=420)
    finally:
        if ring.poll() is None:
            ring.kill()
    assert ring.returncode == 0, out[-2000:] + err[-4000:]
    info = json.loads((tmp_path / "ring" / "run_info.json").read_text())
    assert (info["world"], info["dp"], info["cp"]) == (2, 1, 2)
    assert (tmp_path / "ring" / "final" / "adapter_model.safetensors").is_file()
    return _logs(tmp_path / "one"), _logs(tmp_path / "ring")


@pytest.mark.numerics
@pytest.mark.timeout(900)
def test_dpo_recipe_cpu_variant_matches_one_process(tmp_path):
    """recipes/trl_dpo/run_cpu.sh (cp 2, SmolLM2's real weights) == one process: loss and metrics
    within RTOL each step."""
    one, ring = _run_both("trl_dpo", tmp_path)
    assert len(one) == len(ring) == 2
    for a, b in zip(one, ring):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=RTOL), key
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):  # beta x differences of logps
            assert b[key] == pytest.approx(a[key], abs=0.1 * RTOL * abs(a["logps/chosen"])), key


@pytest.mark.numerics
@pytest.mark.timeout(900)
def test_grpo_recipe_cpu_variant_matches_one_process(tmp_path):
    """recipes/trl_grpo/run_cpu.sh (cp 2, 4 sampled completions per prompt, LoRA, beta 0.05) ==
    one process: the CP group's first rank samples what one process samples (same seed and RNG
    stream), so the completions, rewards and lengths are equal, the loss, KL, entropy and grad
    norm within RTOL (sums over 4 x ~40 tokens, each over SmolLM2's vocabulary: RTOL covers it)."""
    one, ring = _run_both("trl_grpo", tmp_path)
    assert len(one) == len(ring) == 1
    for a, b in zip(one, ring):
        assert sorted(a) == sorted(b)
        for key in a:
            if key.startswith(("reward", "completions/", "frac_", "num_tokens", "clip_ratio/")):
                assert b[key] == a[key], key
            elif key in ("loss", "grad_norm", "kl", "entropy"):
                assert b[key] == pytest.approx(a[key], rel=RTOL, abs=RTOL), key
