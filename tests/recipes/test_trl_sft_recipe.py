"""recipes/trl_sft as shipped: TRL's SFTTrainer with ringft.RingTrainerMixin, launched the way a
user launches it, against the same script as plain TRL in one process (``--cp-size 1``).

- The CPU variant (``run_cpu.sh``: SmolLM2-135M-Instruct, real weights, chat records packed into
  128-token rows, LoRA, 2 processes with ``recipes/accelerate/cpu_2proc.yaml``) vs
  ``ONE_PROCESS=1 run_cpu.sh``.
- DeepSpeed ZeRO-3 on CPU (the shipped ``deepspeed_zero3.yaml``, ``zero3_init_flag`` on, with
  ``mixed_precision: "no"`` and 2 processes), full fine-tuning of a tiny LLaMA (the chunked loss
  reads the partitioned ``lm_head`` through its hooks) vs one process: losses, DeepSpeed's global
  grad norm, the exported weights' update. DeepSpeed builds its CPU ops first
  (tests/train/test_deepspeed.py's fixture: stale build locks cleared, a bounded build).

Tolerances. Tiny model: tests/train/test_hf_trainer.py's (eps32 x the reduction lengths x steps).
SmolLM2: a step's loss is a mean of token cross-entropies, each moved by at most twice the largest
logit error; tests/model/test_real_model.py bounds that error on this model by layers x eps32 x
max|logit| (34) times its 4x spread factor for the massive activations: LOSS_ATOL =
2 * 4 * 30 * eps32 * 34 = 9.7e-4 (0.05 % of a loss of ~2; a target lost at a chunk edge moves it
by 1/128 of itself, a loss scaled by cp by 100 %).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ringft.ops.spawn import free_port
from tests.train.test_deepspeed import _env, deepspeed_ops_built  # noqa: F401  (module fixture)
from tests.train.test_trainer import assert_updates_close

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "trl_sft"
EPS32 = torch.finfo(torch.float32).eps
LOSS_ATOL = 2 * 4.0 * 30 * EPS32 * 34
TIMEOUT = 420


def _losses(out: Path, key: str = "loss") -> list[float]:
    return [h[key] for h in json.loads((out / "log_history.json").read_text()) if key in h and "loss" in h]


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _accelerate() -> str:
    return str(Path(sys.executable).parent / "accelerate")


@pytest.mark.numerics
@pytest.mark.timeout(2 * TIMEOUT)
def test_cpu_variant_matches_one_process(tmp_path):
    """run_cpu.sh (cp 2) == ONE_PROCESS=1 run_cpu.sh: the same packed chat batches, the same loss
    every step (SmolLM2's real weights), an adapter saved."""
    from tests.real_model import smollm2_path

    env = dict(_env(), MODEL=str(smollm2_path()), PYTHON=sys.executable, ACCELERATE=_accelerate())
    ring, one = tmp_path / "ring", tmp_path / "one"
    launch = f"--main_process_port {free_port()}"
    _run(["bash", str(RECIPE / "run_cpu.sh")], dict(env, OUTPUT_DIR=str(ring), LAUNCH_ARGS=launch))
    _run(["bash", str(RECIPE / "run_cpu.sh")], dict(env, OUTPUT_DIR=str(one), ONE_PROCESS="1"))
    assert json.loads((ring / "run_info.json").read_text())["cp"] == 2
    assert json.loads((ring / "run_info.json").read_text())["world"] == 2
    assert len(_losses(ring)) == 2
    assert _losses(ring) == pytest.approx(_losses(one), abs=LOSS_ATOL)
    assert (ring / "final" / "adapter_model.safetensors").is_file()


def _tiny_model_dir(path: Path) -> Path:
    """A 2-layer LLaMA (hidden 32) with the demo tokenizer and a plain chat template."""
    from tests.train.hf_runs import tiny_model, tokenizer

    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tiny_model(tok, lora=False).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.mark.numerics
@pytest.mark.timeout(2 * TIMEOUT)
def test_zero3_matches_one_process(tmp_path):
    """ZeRO-3 (2 ranks, cp 2, full fine-tuning) == one process: losses, grad norms, weights."""
    from safetensors.torch import load_file

    from tests.train.test_hf_trainer import LOSS_RTOL, UPDATE_RTOL

    model = _tiny_model_dir(tmp_path / "tiny")
    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / "deepspeed_zero3.yaml").read_text())
    assert cfg["deepspeed_config"]["zero3_init_flag"] is True  # tested as shipped
    cfg.update(mixed_precision="no", num_processes=2, main_process_port=free_port())
    (tmp_path / "zero3.yaml").write_text(yaml.safe_dump(cfg))
    args = ["--model", str(model), "--dataset", "synthetic-chat:96", "--max-length", "128"]
    args += ["--micro-batch", "2", "--max-steps", "4", "--lr", "1e-3"]
    script = str(RECIPE / "sft.py")
    env = dict(_env(), OMP_NUM_THREADS="1")
    launch = [_accelerate(), "launch", "--config_file", str(tmp_path / "zero3.yaml"), script]
    _run([*launch, *args, "--cp-size", "2", "--output-dir", str(tmp_path / "zero3")], env)
    _run([sys.executable, script, *args, "--output-dir", str(tmp_path / "one")], env)
    info = json.loads((tmp_path / "zero3" / "run_info.json").read_text())
    assert info["distributed_type"] == "DistributedType.DEEPSPEED" and info["cp"] == 2
    assert _losses(tmp_path / "zero3") == pytest.approx(_losses(tmp_path / "one"), rel=LOSS_RTOL)
    grad_norms = _losses(tmp_path / "one", "grad_norm")
    assert _losses(tmp_path / "zero3", "grad_norm") == pytest.approx(grad_norms, rel=UPDATE_RTOL)
    final = load_file(str(tmp_path / "zero3" / "final" / "model.safetensors"))
    want = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert_updates_close(final, want, load_file(str(model / "model.safetensors")), UPDATE_RTOL)
    assert os.path.getsize(tmp_path / "zero3" / "final" / "model.safetensors") > 0
