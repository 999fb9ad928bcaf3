"""``ringft train`` through ``transformers.Trainer`` + ``RingTrainerMixin`` (ringft.train.front).

The tiny training of tests/tiny_training.py (fp32 LLaMA from config, ragged random-token rows with
masked prefixes), world 2 on gloo CPU processes:

- cp 2 trains what one transformers process trains (the same recipe at cp 1 in the test process,
  full-logits loss: the unmodified model's forward; full fine-tuning and LoRA): the same losses and
  updates within LOSS_RTOL / UPDATE_RTOL (tests/tiny_training.py: the same math with fp32 sums
  reordered by the ring);
- kill and resume: 6 steps saved every 2 (keep 2: rotation), a run SIGKILLed after step 3 resumes
  from the mid-epoch checkpoint-2 and ends with A's losses and weights, bit for bit; metrics.jsonl
  holds each step once;
- the run folder: a busy folder (locked) and a folder with checkpoints (without --resume) are
  refused before anything is written; a damaged newest checkpoint is named with the newest
  complete one; a recipe that changes the data order is refused.
A full disk on one rank (a checkpoint save, metrics.jsonl) and the refusals through the CLI on two
ranks: tests/train/test_faults_train.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringft.train.errors import RecipeError
from ringft.train.recipe import recipe_from_dict
from ringft.utils.spawn import run_distributed
from tests.tiny_training import (
    LOSS_RTOL,
    RUN_TIMEOUT,
    UPDATE_RTOL,
    assert_updates_close,
    assert_weights_equal,
    final_weights,
    in_process_front,
    initial_weights,
    tiny_recipe,
)
from tests.workers import train_runs


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    from tests.tiny_training import save_random_tokens

    return save_random_tokens(tmp_path_factory.mktemp("front_data") / "ds")


def _recipe(out: Path, data: str, **sections) -> dict:
    sections.setdefault("parallel", {"cp_size": 2})
    return tiny_recipe(out, data, **sections)


def _one_process(raw: dict) -> list[float]:
    """The losses of ``raw`` at cp 1, trained in the test process (world 1)."""
    with in_process_front(raw) as run:
        return run.run().losses


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_front_matches_one_process_and_resumes_exactly(tmp_path, data_path):
    resumable = {
        "train": {"max_steps": 6, "warmup_steps": 0},
        "checkpoint": {"save_every": 2, "keep": 2},
    }
    lora = {"lora": {"r": 4, "alpha": 8}}
    runs = [
        {"recipe": _recipe(tmp_path / "front", data_path)},
        {"recipe": _recipe(tmp_path / "frontL", data_path, **lora)},
        {"recipe": _recipe(tmp_path / "A", data_path, **resumable), "record": str(tmp_path / "A.json")},
        {"recipe": _recipe(tmp_path / "B", data_path, **resumable), "kill": "step:3:1"},
    ]
    with pytest.raises(RuntimeError) as info:
        run_distributed(train_runs, 2, runs, str(tmp_path / "call1"), timeout=RUN_TIMEOUT * 2)
    assert "rank(s) [1]" in str(info.value) and "[-9]" in str(info.value), str(info.value)[-2000:]
    # (the first runs' results died with the call: their metrics.jsonl hold every step's loss)

    def logged(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    one = _recipe(tmp_path / "one", data_path, parallel={"cp_size": 1})
    oneL = _recipe(tmp_path / "oneL", data_path, parallel={"cp_size": 1}, **lora)
    for ring, reference in [("front", _one_process(one)), ("frontL", _one_process(oneL))]:
        assert len(reference) == 4 and logged(ring) == pytest.approx(reference, rel=LOSS_RTOL), ring
    assert_updates_close(
        final_weights(tmp_path / "front"), final_weights(tmp_path / "one"), initial_weights(one), UPDATE_RTOL
    )
    # LoRA: the B matrices, which start at zero (their update is their value)
    ring_b, one_b = final_weights(tmp_path / "frontL"), final_weights(tmp_path / "oneL")
    zeros = {k: torch.zeros_like(v) for k, v in one_b.items()}
    lora_b = [k for k in one_b if "lora_B" in k]
    assert lora_b and set(ring_b) == set(one_b)
    assert_updates_close({k: ring_b[k] for k in lora_b}, {k: one_b[k] for k in lora_b}, zeros, UPDATE_RTOL)
    a = json.loads((tmp_path / "A.json").read_text())
    assert len(a["losses"]) == 6
    assert sorted(p.name for p in (tmp_path / "A").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert {"config.json", "model.safetensors", "ringft_recipe.json"} <= {
        p.name for p in (tmp_path / "A" / "final").iterdir()
    }
    assert sorted(p.name for p in (tmp_path / "B").glob("checkpoint-*")) == ["checkpoint-2"]

    (b,) = run_distributed(
        train_runs,
        2,
        [{"recipe": _recipe(tmp_path / "B", data_path, **resumable), "resume": True}],
        str(tmp_path / "call2"),
        timeout=RUN_TIMEOUT,
    )[0]
    assert b["start_step"] == 2
    assert b["losses"] == a["losses"][2:]  # the same operations in the same order: exact
    assert_weights_equal(final_weights(tmp_path / "B"), final_weights(tmp_path / "A"))
    rows = [json.loads(x) for x in (tmp_path / "B" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == a["losses"]


def _folder(tmp_path: Path, data: str, **sections):
    from ringft.train.front_runs import RunFolder

    return RunFolder(recipe_from_dict(_recipe(tmp_path / "out", data, **sections)), world_size=2)


def _fake_checkpoint(folder, step: int, complete: bool = True) -> Path:
    from ringft.train.front_runs import RUN_FILE

    path = folder.out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / RUN_FILE).write_text(json.dumps({"step": step, **folder.run_state()}))
    return path


def test_run_folder_refusals(tmp_path, data_path):
    from ringft.train.run_folder import OutputDirLock

    folder = _folder(tmp_path, data_path)
    holder = OutputDirLock(folder.out)
    assert holder.acquire() is None
    with pytest.raises(RecipeError, match="in use by another ringft run"):
        folder.claim(False, is_main=True)
    holder.release()
    assert not (folder.out / "metrics.jsonl").exists()

    (folder.out / "final").mkdir()
    (folder.out / "final" / "ringft_recipe.json").write_text("{}")  # a finished run without checkpoints
    with pytest.raises(RecipeError, match="holds the export of a finished run .final/.: choose another"):
        folder.claim(False, is_main=True)
    with pytest.raises(RecipeError, match="--resume: .* finished run .final/. and no checkpoint to continue"):
        folder.claim(True, is_main=True)

    _fake_checkpoint(folder, 2)
    with pytest.raises(RecipeError, match="already holds checkpoints of a run .checkpoint-2.: pass --resume"):
        folder.claim(False, is_main=True)
    _fake_checkpoint(folder, 4, complete=False)
    with pytest.raises(RecipeError, match="checkpoint-4 is damaged .* newest complete one is .*checkpoint-2"):
        folder.claim(True, is_main=True)
    other = _folder(tmp_path, data_path, train={"seed": 3})
    with pytest.raises(RecipeError, match="train.seed 0 -> 3"):
        other.claim(str(folder.out / "checkpoint-2"), is_main=True)
    folder.claim(str(folder.out / "checkpoint-2"), is_main=True)
    assert (folder.resume_from, folder.start_step) == (str(folder.out / "checkpoint-2"), 2)
    folder.release()


def test_epochs_eval_split_hub_and_hf_names(tmp_path, data_path, monkeypatch):
    """One process: Hugging Face names in the recipe, epochs instead of max_steps, a held-out eval
    split with eval loss during training (checked against a plain forward of the trained model),
    tensorboard, and the export pushed to the Hub (stubbed at huggingface_hub's boundary)."""
    import huggingface_hub
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from ringft.model.patch import remove_ring_attention
    from ringft.train import front

    pushed = []
    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: pushed.append(repo_id)
    )
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "upload_folder",
        lambda self, folder_path, repo_id, **kw: pushed.append(
            sorted(p.name for p in Path(folder_path).iterdir())
        ),
    )
    raw = tiny_recipe(
        tmp_path / "out",
        data_path,
        train={"num_train_epochs": 2, "eval_steps": 6, "learning_rate": 1e-3, "max_grad_norm": 1.0},
        data={"eval_fraction": 0.23},  # 11 rows: a last eval batch of 1 row, read (dp 1)
        checkpoint={"push_to_hub": True, "hub_model_id": "someone/tiny", "save_total_limit": 1},
        logging={"report_to": "tensorboard"},
    )
    del raw["train"]["lr"], raw["train"]["grad_clip"], raw["checkpoint"]["keep"]
    del raw["logging"]["tracker"]  # (the keys above: given by their Hugging Face names)
    recipe = recipe_from_dict(raw)
    assert (recipe.train.lr, recipe.train.eval_every, recipe.logging.tracker) == (1e-3, 6, "tensorboard")
    try:
        trainer, folder = front.build_trainer(recipe, progress=False)
        try:
            result = front._run(trainer, folder, recipe)
        finally:
            folder.release()
        # 48 rows: 11 held out, 37 train = 18 steps of 2 rows per epoch (the last row dropped)
        assert result.steps == 36 and len(result.losses) == 36
        rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval_loss" in r]
        assert [r["step"] for r in evals] == [6, 12, 18, 24, 30, 36]
        assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
        # the last eval loss as one process computes it (transformers' mean over the eval rows of
        # their batch's mean token loss), from plain forwards of the trained model, fp64
        model = trainer.model
        remove_ring_attention(model)
        rows = list(trainer.eval_dataset)
        batch_losses = []
        with torch.no_grad():
            for i in range(0, len(rows), 2):
                total, count = 0.0, 0
                for row in rows[i : i + 2]:
                    logits = model._ringft_previous_forward(input_ids=torch.tensor([row["input_ids"]])).logits
                    target = torch.tensor(row["labels"][1:])
                    keep = target != -100
                    ce = torch.nn.functional.cross_entropy(
                        logits[0, :-1].double()[keep], target[keep], reduction="sum"
                    )
                    total, count = total + ce.item(), count + int(keep.sum())
                batch_losses += [total / count] * len(rows[i : i + 2])
        assert len(batch_losses) == 11
        expected = sum(batch_losses) / len(batch_losses)
        # fp32 sums over a batch's tokens and the vocabulary vs fp64: LOSS_RTOL (tests/tiny_training.py)
        assert abs(evals[-1]["eval_loss"] - expected) <= LOSS_RTOL * expected
        assert pushed[0] == "someone/tiny" and "model.safetensors" in pushed[1]
        assert list((tmp_path / "out").rglob("events.out.tfevents*"))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_data_without_a_whole_batch_over_the_replicas_is_refused():
    """A training set smaller than one batch would train 0 steps and export the untrained model;
    dp > 1 reads whole global eval batches only, so a smaller eval split would evaluate nothing,
    silently: both refused (dp 1 reads a partial eval batch: fine)."""
    from types import SimpleNamespace

    from ringft.train.front import _check_batches

    def trainer(dp: int, train: int, evals: int | None = None) -> SimpleNamespace:
        evals = None if evals is None else [{}] * evals
        return SimpleNamespace(
            ring_layout=SimpleNamespace(dp_size=dp), train_dataset=[{}] * train, eval_dataset=evals
        )

    _check_batches(trainer(1, 2, 1), micro_batch_size=2)
    _check_batches(trainer(2, 4, 4), micro_batch_size=2)
    with pytest.raises(RecipeError, match="training set holds 3 rows, fewer than one batch of 4 rows"):
        _check_batches(trainer(2, 3), micro_batch_size=2)
    with pytest.raises(RecipeError, match="eval split holds 3 rows, fewer than one eval batch of 4 rows"):
        _check_batches(trainer(2, 4, 3), micro_batch_size=2)
    with pytest.raises(RecipeError, match="eval split holds 0 rows"):
        _check_batches(trainer(1, 2, 0), micro_batch_size=2)


def test_wandb_project_is_the_recipes(tmp_path, monkeypatch):
    """logging.project names the wandb project (transformers' WandbCallback reads WANDB_PROJECT);
    without the wandb package the tracker is refused before any model loads."""
    import importlib.util
    import os

    from ringft.train.front import _tracker_setup

    raw = tiny_recipe(tmp_path, tmp_path, logging={"tracker": "wandb", "project": "long-ctx"})
    raw["data"] = {"synthetic": {}, "seq_len": 64}
    recipe = recipe_from_dict(raw)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RecipeError, match="logging.tracker wandb needs the wandb package"):
        _tracker_setup(recipe)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    _tracker_setup(recipe)
    assert os.environ["WANDB_PROJECT"] == "long-ctx"
