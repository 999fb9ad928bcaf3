"""The trainer under DeepSpeed ZeRO-3 (with and without CPU offload), launched exactly as a user
launches it: ``accelerate launch --config_file recipes/accelerate/deepspeed_zero3*.yaml -m ringft
train``. DeepSpeed runs on its CPU accelerator over gloo here (``pip install deepspeed``; the
dev extra installs it), so the same trainer code paths run as on GPUs: partitioned parameters,
the engine's own gradient accumulation and clipping, the partitioned ``lm_head`` read by the
chunked loss through its module hooks, DeepSpeed checkpoints inside ringft's atomic
``step-N.tmp -> step-N`` rename, and the gathered 16-bit state dict at export.

Oracle: the same recipe on one plain process (no DeepSpeed, no ring, full-logits loss) with the
same global batch. The launch configs are the shipped ones with two keys changed for the test:
``mixed_precision: "no"`` (fp32, so that round-off stays at ~1e-7) and ``zero3_init_flag: false``
(under ``deepspeed.zero.Init`` a model built *from config* gets a different random initialisation
than in one process; from_pretrained weights, the real use, are loaded identically either way).

Tolerances (fp32): per-step losses 1e-5 absolute and final weights 1e-5 absolute, as in
tests/test_trainer.py (the runs only reorder fp32 sums; a wrong loss scale under DeepSpeed's
``1 / gradient_accumulation_steps`` or its world averaging is O(lr) = 1e-3 per step). The offload
run uses DeepSpeedCPUAdam (vectorised fp32 Adam) instead of torch's AdamW: same tolerance.
Resuming a DeepSpeed checkpoint replays the same operations: 1e-6 (observed exact).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ringft.testing import free_port, run_distributed
from tests.test_trainer import (
    LOSS_ATOL,
    RUN_TIMEOUT,
    WEIGHT_ATOL,
    _train_runs,
    assert_weights_close,
    data_path,  # noqa: F401  (module-scoped fixture)
    final_weights,
    tiny_recipe,
)

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 420


def _launch_config(tmp_path: Path, name: str, num_processes: int) -> Path:
    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / name).read_text())
    assert cfg["distributed_type"] == "DEEPSPEED" and cfg["deepspeed_config"]["zero_stage"] == 3
    cfg["mixed_precision"] = "no"
    cfg["deepspeed_config"]["zero3_init_flag"] = False
    cfg["num_processes"] = num_processes
    cfg["main_process_port"] = free_port()
    path = tmp_path / f"launch-{name}"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(tmp_path: Path, launch_config: Path, raw: dict, *extra: str) -> None:
    recipe = tmp_path / f"recipe-{Path(raw['checkpoint']['output_dir']).name}.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_config),
        "-m", "ringft", "train", str(recipe), "--no-progress", *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "ringft: " in proc.stdout, proc.stdout[-3000:]


def _metric(output_dir: Path, key: str = "loss") -> list[float]:
    """One column of the run's metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows]


def _reference(tmp_path: Path, data: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    single = tiny_recipe(tmp_path / "one", data, train={"micro_batch_size": 4})
    ref = run_distributed(_train_runs, 1, [{"recipe": single}], str(tmp_path), timeout=RUN_TIMEOUT)
    return ref[0][0]["losses"], final_weights(tmp_path / "one")


def _zero3_recipe(output_dir: Path, data: str) -> dict:
    """dp=2 x cp=2 on 4 ranks, micro-batch 1 x grad_accum 2 (global batch 4), chunked loss reading
    the partitioned lm_head, gradient checkpointing, a checkpoint every 2 steps."""
    return tiny_recipe(
        output_dir, data, parallel={"cp_size": 2},
        train={"micro_batch_size": 1, "grad_accum": 2, "chunked_loss": True, "gradient_checkpointing": True},
        checkpoint={"save_every": 2, "keep": 3},
    )


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
def test_zero3_matches_one_process_and_resumes(tmp_path, data_path):  # noqa: F811
    """ZeRO-3 (dp=2 x cp=2, grad_accum 2) == one process on the same global batch: losses and
    exported weights; then --resume from the step-2 DeepSpeed checkpoint ends at the same weights."""
    ref_losses, ref_weights = _reference(tmp_path, data_path)
    launch = _launch_config(tmp_path, "deepspeed_zero3.yaml", 4)
    out = tmp_path / "zero3"
    _launch(tmp_path, launch, _zero3_recipe(out, data_path))
    losses = _metric(out)
    assert losses == pytest.approx(ref_losses, abs=LOSS_ATOL)
    # DeepSpeed's global gradient norm (what it clips with) == the one-process norm.
    assert _metric(out, "grad_norm") == pytest.approx(_metric(tmp_path / "one", "grad_norm"), rel=1e-5)
    weights = final_weights(out)
    assert_weights_close(weights, ref_weights, WEIGHT_ATOL)
    step2 = out / "checkpoints" / "step-00000002"
    assert (step2 / "pytorch_model").is_dir(), sorted(p.name for p in step2.iterdir())  # ZeRO shards

    # Resume: keep only the step-2 checkpoint, train steps 3 and 4 again.
    again = tmp_path / "zero3-resumed"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("final", "metrics.jsonl", "logs"))
    shutil.rmtree(again / "checkpoints" / "step-00000004")
    _launch(tmp_path, launch, _zero3_recipe(again, data_path), "--resume")
    assert _metric(again) == pytest.approx(losses[2:], abs=1e-6)
    assert_weights_close(final_weights(again), weights, 1e-6)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_zero3_cpu_offload_matches_one_process(tmp_path, data_path):  # noqa: F811
    """ZeRO-3 with optimizer and parameters offloaded to CPU memory (DeepSpeedCPUAdam, which
    accelerate swaps in for AdamW; the learning-rate schedule must reach it): dp=1 x cp=2, micro 2
    x grad_accum 2 == one process with micro 4."""
    ref_losses, ref_weights = _reference(tmp_path, data_path)
    raw = tiny_recipe(
        tmp_path / "offload", data_path, parallel={"cp_size": 2},
        train={"micro_batch_size": 2, "grad_accum": 2, "chunked_loss": True},
    )
    _launch(tmp_path, _launch_config(tmp_path, "deepspeed_zero3_offload.yaml", 2), raw)
    assert _metric(tmp_path / "offload") == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_weights_close(final_weights(tmp_path / "offload"), ref_weights, WEIGHT_ATOL)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_zero3_lora_matches_one_process(tmp_path, data_path):  # noqa: F811
    """LoRA (q/v) under ZeRO-3, dp=1 x cp=2: losses and the exported adapter == one process."""
    from safetensors.torch import load_file

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    train = {"lr": 1e-2, "chunked_loss": True}
    single = tiny_recipe(tmp_path / "one", data_path, train=train, lora=lora)
    ref = run_distributed(_train_runs, 1, [{"recipe": single}], str(tmp_path), timeout=RUN_TIMEOUT)
    raw = tiny_recipe(tmp_path / "lora", data_path, parallel={"cp_size": 2}, train=train, lora=lora)
    _launch(tmp_path, _launch_config(tmp_path, "deepspeed_zero3.yaml", 2), raw)
    assert _metric(tmp_path / "lora") == pytest.approx(ref[0][0]["losses"], abs=LOSS_ATOL)
    got = load_file(str(tmp_path / "lora" / "final" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "one" / "final" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and any("lora_B" in k for k in got)
    assert max(float(got[k].norm()) for k in got if "lora_B" in k) > 0  # trained
    assert_weights_close(got, want, WEIGHT_ATOL)
