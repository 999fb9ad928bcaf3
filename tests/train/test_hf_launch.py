"""RingTrainerMixin launched the way a user launches it (``accelerate launch``, recipes/trl_sft as
shipped), against the same script as plain TRL in one process (``--cp-size 1``; those references
run in the 2-process spawn of tests/train/conftest.py, one process start for all of them).

- The CPU variant of the recipe (``recipes/trl_sft/run_cpu.sh``: SmolLM2-135M-Instruct, real
  weights, chat records packed into 128-token rows, LoRA, 2 processes with
  ``recipes/accelerate/cpu_2proc.yaml``) vs the command ``ONE_PROCESS=1 run_cpu.sh`` runs.
- DeepSpeed ZeRO-3 on CPU (the shipped ``deepspeed_zero3.yaml``, ``zero3_init_flag`` on, with
  ``mixed_precision: "no"`` and 2 processes, cp 2), full fine-tuning of the tiny LLaMA (the chunked
  loss reads the partitioned ``lm_head`` through its hooks) vs one process: losses, DeepSpeed's
  global grad norm, the exported weights' update. DeepSpeed builds its CPU ops first
  (tests/train/launch_env.py: stale build locks cleared, a bounded build).

Tolerances. Tiny model: tests/train/test_hf_trainer.py's (eps32 x the reduction lengths x steps).
SmolLM2: a step's loss is a mean of token cross-entropies, each moved by at most twice the largest
logit error; tests/model/test_real_model.py bounds that error on this model by layers x eps32 x
max|logit| (34) times its 4x spread factor for the massive activations: LOSS_ATOL =
2 * 4 * 30 * eps32 * 34 = 9.7e-4 (0.05 % of a loss of ~2; a target lost at a chunk edge moves it
by 1/128 of itself, a loss scaled by cp by 100 %).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ringft.utils.spawn import free_port
from tests.train.hf_runs import LOSS_RTOL, UPDATE_RTOL, assert_updates_close, zero3_argv
from tests.train.launch_env import launch_env

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "trl_sft"
EPS32 = torch.finfo(torch.float32).eps
LOSS_ATOL = 2 * 4.0 * 30 * EPS32 * 34
TIMEOUT = 420


def _logged(out: Path, key: str = "loss") -> list[float]:
    return [h[key] for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _accelerate() -> str:
    return str(Path(sys.executable).parent / "accelerate")


@pytest.mark.numerics
@pytest.mark.timeout(2 * TIMEOUT)
def test_recipe_cpu_variant_matches_one_process(tmp_path, hf_two):
    """run_cpu.sh (cp 2, SmolLM2's real weights) == its one-process command: the same packed chat
    batches, the same loss every step; an adapter saved."""
    from tests.real_model import smollm2_path

    ring = tmp_path / "ring"
    env = launch_env(MODEL=str(smollm2_path()), PYTHON=sys.executable, ACCELERATE=_accelerate())
    env.update(OUTPUT_DIR=str(ring), LAUNCH_ARGS=f"--main_process_port {free_port()}")
    _run(["bash", str(RECIPE / "run_cpu.sh")], env)
    info = json.loads((ring / "run_info.json").read_text())
    assert (info["world"], info["dp"], info["cp"]) == (2, 1, 2)
    one = hf_two["smollm2-one"]
    assert len(one["losses"]) == 2
    assert _logged(ring) == pytest.approx(one["losses"], abs=LOSS_ATOL)
    assert (ring / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.numerics
@pytest.mark.timeout(2 * TIMEOUT)
def test_zero3_matches_one_process(tmp_path, hf_two, hf_root, deepspeed_ops):
    """ZeRO-3 (2 ranks, cp 2, full fine-tuning) == one process: losses, grad norms, weights."""
    from safetensors.torch import load_file

    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / "deepspeed_zero3.yaml").read_text())
    assert cfg["deepspeed_config"]["zero3_init_flag"] is True  # tested as shipped
    cfg.update(mixed_precision="no", num_processes=2, main_process_port=free_port())
    (tmp_path / "zero3.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "zero3"
    launch = [_accelerate(), "launch", "--config_file", str(tmp_path / "zero3.yaml"), str(RECIPE / "sft.py")]
    _run(
        [*launch, *zero3_argv(str(hf_root / "tiny"), str(out)), "--cp_size", "2"],
        launch_env(),
    )
    info = json.loads((out / "run_info.json").read_text())
    assert info["distributed_type"] == "DistributedType.DEEPSPEED" and info["cp"] == 2
    one = hf_two["zero3-one"]
    assert len(one["losses"]) == 4
    assert _logged(out) == pytest.approx(one["losses"], rel=LOSS_RTOL)
    assert _logged(out, "grad_norm") == pytest.approx(one["grad_norms"], rel=UPDATE_RTOL)
    got = load_file(str(out / "final" / "model.safetensors"))
    want = load_file(str(hf_root / "zero3-one" / "final" / "model.safetensors"))
    assert_updates_close(got, want, load_file(str(hf_root / "tiny" / "model.safetensors")), UPDATE_RTOL)
