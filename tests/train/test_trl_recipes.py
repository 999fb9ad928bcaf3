"""recipes/trl_dpo/run_cpu.sh and recipes/trl_grpo/run_cpu.sh (2 CPU processes, cp 2,
SmolLM2-135M-Instruct's real weights, LoRA: the reference model is the adapter disabled) against
their one-process command (``ONE_PROCESS=1``: TRL's trainer unchanged), both launched at once:
every logged DPO / GRPO metric, step by step.

Tolerance: the logged values are fp32 sums over at most 2 x 2 sequences of ~60 tokens, each token
a log-softmax over SmolLM2's 49152-token vocabulary; LOSS_RTOL's derivation (tests/train/hf_runs.py)
with this vocabulary gives (4 * 64 + 49152) * eps32 = 5.9e-3 relative, far above what the ring
changes (~1e-6 observed) and far below what a sum over one shard (x 0.5) or a metric gathered
over every rank (num_tokens x 2) would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringft.ops.spawn import free_port
from tests.train.hf_runs import EPS32
from tests.train.launch_env import launch_env

REPO = Path(__file__).resolve().parents[2]
RTOL = (4 * 64 + 49152) * EPS32
KEYS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/accuracies", "entropy", "num_tokens")


def _logs(out: Path) -> list[dict]:
    return [h for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]


def _run_both(recipe: str, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """recipes/<recipe>/run_cpu.sh as the ring (2 processes) and as one process, launched together
    (one wall-clock wait); their logs."""
    from tests.real_model import smollm2_path

    accelerate = str(Path(sys.executable).parent / "accelerate")
    base = dict(MODEL=str(smollm2_path()), PYTHON=sys.executable, ACCELERATE=accelerate)
    runs = {
        "one": dict(base, ONE_PROCESS="1", OUTPUT_DIR=str(tmp_path / "one")),
        "ring": dict(
            base, OUTPUT_DIR=str(tmp_path / "ring"), LAUNCH_ARGS=f"--main_process_port {free_port()}"
        ),
    }
    procs = {
        name: subprocess.Popen(
            ["bash", str(REPO / "recipes" / recipe / "run_cpu.sh")],
            env=launch_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, env in runs.items()
    }
    for proc in procs.values():
        try:
            out, err = proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
    info = json.loads((tmp_path / "ring" / "run_info.json").read_text())
    assert (info["world"], info["dp"], info["cp"]) == (2, 1, 2)
    assert (tmp_path / "ring" / "final" / "adapter_model.safetensors").is_file()
    return _logs(tmp_path / "one"), _logs(tmp_path / "ring")


@pytest.mark.numerics
@pytest.mark.timeout(900)
def test_dpo_recipe_cpu_variant_matches_one_process(tmp_path):
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
