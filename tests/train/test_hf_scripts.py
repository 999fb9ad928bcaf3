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


def test_loss_chunk_size_without_a_ring_is_refused():
    """``--loss_chunk_size`` with ``--cp_size 1``: the base trainer computes its own loss, so the
    flag would be ignored: refused."""
    assert RingArguments(cp_size=1).trainer_keywords() == {}
    with pytest.raises(SystemExit, match="--loss_chunk_size applies to the ring"):
        RingArguments(cp_size=1, loss_chunk_size=1024).trainer_keywords()


def test_model_flags_reach_from_pretrained(monkeypatch):
    """TRL's model flags are used as TRL's own scripts use them (none silently ignored); a quantized
    base is refused by name."""
    import torch
    import transformers
    from trl import ModelConfig

    from ringft.train.hf.scripts import load_model

    calls = {}

    def recorder(kind):
        return classmethod(lambda cls, name, **kw: calls.setdefault(kind, (name, kw)))

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recorder("model"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recorder("tokenizer"))
    model_args = ModelConfig(
        model_name_or_path="m", model_revision="r1", dtype="bfloat16", attn_implementation="eager"
    )
    config = SimpleNamespace(trust_remote_code=True, model_init_kwargs={"low_cpu_mem_usage": True})
    load_model(model_args, config, padding_side="left")
    assert calls["model"] == (
        "m",
        dict(
            revision="r1",
            trust_remote_code=True,
            attn_implementation="eager",
            dtype=torch.bfloat16,
            low_cpu_mem_usage=True,
        ),
    )
    assert calls["tokenizer"] == ("m", dict(revision="r1", trust_remote_code=True, padding_side="left"))
    assert config.model_init_kwargs is None  # applied here, not again by the trainer
    for flag in ("load_in_4bit", "load_in_8bit"):
        with pytest.raises(SystemExit, match="--load_in_4bit / --load_in_8bit: quantized"):
            load_model(ModelConfig(model_name_or_path="m", **{flag: True}), config)
