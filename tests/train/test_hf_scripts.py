"""The datasets the TRL recipe scripts (recipes/trl_*/*.py) hand their trainer from TRL's
``ScriptArguments``: an eval split whenever ``--eval_strategy`` asks for evaluation (the Trainer
refuses evaluation without one), never the training records again."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ringft.train.hf.scripts import RingArguments, script_datasets


def _records(n: int, seed: int) -> list[dict]:
    return [{"text": f"record {seed}-{i}"} for i in range(n)]


def _args(name: str | None, eval_strategy: str = "steps", test: str = "test"):
    script = SimpleNamespace(
        dataset_name=name, dataset_config=None, dataset_train_split="train", dataset_test_split=test
    )
    return script, SimpleNamespace(seed=3, eval_strategy=eval_strategy)


def test_eval_split_follows_eval_strategy(tmp_path):
    assert set(script_datasets(*_args("made-up:4", "no"), "made-up", _records)) == {"train_dataset"}
    data = script_datasets(*_args(None), "made-up", _records)  # no --dataset_name: the made-up records
    assert data["train_dataset"]["text"] == [f"record 3-{i}" for i in range(512)]
    assert data["eval_dataset"]["text"][0] == "record 4-0"  # other records (seed + 1)
    assert "eval_dataset" not in script_datasets(*_args("made-up:4"), "made-up", _records, evaluate=False)

    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    for path, rows in ((train, _records(4, 0)), (held_out, _records(2, 9))):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="--dataset_test_split FILE.jsonl"):
        script_datasets(*_args(str(train)), "made-up", _records)
    data = script_datasets(*_args(str(train), test=str(held_out)), "made-up", _records)
    assert (len(data["train_dataset"]), data["eval_dataset"]["text"]) == (4, ["record 9-0", "record 9-1"])


def test_ulysses_size_that_cannot_split_the_ring_is_refused():
    """``--ulysses_size 2`` without a ring of 2 is refused (with ``--cp_size 1`` the base trainer
    would run and silently ignore it)."""
    assert RingArguments(cp_size=4, ulysses_size=2).trainer_keywords()["ulysses_size"] == 2
    for cp in (1, 3):
        with pytest.raises(SystemExit, match=f"ulysses_size=2 does not divide cp_size={cp}"):
            RingArguments(cp_size=cp, ulysses_size=2).trainer_keywords()
