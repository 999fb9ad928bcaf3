"""The recipe schema: every key typed and range-checked where the recipe is loaded (issue 16), typos
refused in every section (data.synthetic included, issue 11), one line naming key, value and fix;
checks against the launch (world size, model type) and the CLI's error path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringft.train.recipe import RecipeError, apply_overrides, load_recipe, recipe_from_dict, validate
from tests.tiny_training import in_process_front, tiny_recipe

REPO = Path(__file__).resolve().parents[2]


def _raw(tmp_path, **sections) -> dict:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return tiny_recipe(tmp_path / "out", data, **sections)


# (section, key, bad value, words the one-line message must contain)
BAD_VALUES = [
    ("train", "lr", -1, ["train.lr", "> 0", "-1"]),
    ("train", "lr", 0, ["train.lr", "> 0"]),
    ("train", "lr", "fast", ["train.lr", "a number", "'fast'"]),
    ("train", "lr", float("nan"), ["train.lr", "finite"]),
    ("train", "max_steps", "20", ["train.max_steps", "integer", "write 20 without quotes"]),
    ("train", "max_steps", 20.5, ["train.max_steps", "integer", "20.5", "whole number"]),
    ("train", "max_steps", 0, ["train.max_steps", ">= 1", "got 0"]),
    ("train", "max_steps", True, ["train.max_steps", "integer", "True"]),
    ("train", "micro_batch_size", 0, ["train.micro_batch_size", ">= 1"]),
    ("train", "grad_accum", -2, ["train.grad_accum", ">= 1"]),
    ("train", "warmup_steps", -1, ["train.warmup_steps", ">= 0"]),
    ("train", "min_lr_ratio", 1.5, ["train.min_lr_ratio", "<= 1"]),
    ("train", "weight_decay", -0.1, ["train.weight_decay", ">= 0"]),
    ("train", "betas", [0.9], ["train.betas", "two numbers"]),
    ("train", "betas", [0.9, 1.0], ["train.betas", "[0, 1)"]),
    ("train", "grad_clip", -1, ["train.grad_clip", ">= 0"]),
    ("train", "gradient_checkpointing", "yes", ["train.gradient_checkpointing", "true or false"]),
    ("train", "chunked_loss", 1, ["train.chunked_loss", "true or false"]),
    ("train", "tiled_mlp_tokens", 0, ["train.tiled_mlp_tokens", ">= 1"]),
    ("train", "tiled_norm_tokens", 0, ["train.tiled_norm_tokens", ">= 1"]),
    ("train", "attention_tile_tokens", 0, ["train.attention_tile_tokens", ">= 1", "got 0"]),
    ("train", "attention_tile_tokens", 512.0, ["train.attention_tile_tokens", "integer"]),
    ("train", "fused_rmsnorm", "yes", ["train.fused_rmsnorm", "true or false"]),
    ("train", "attention_checkpoint", "keep", ["train.attention_checkpoint", "recompute, save, offload"]),
    ("train", "loss_chunk_size", 0, ["train.loss_chunk_size", ">= 1"]),
    ("train", "seed", -1, ["train.seed", ">= 0"]),
    ("train", "schedule", "linear", ["train.schedule", "constant, cosine", "'linear'"]),
    ("logging", "log_every", 0, ["logging.log_every", ">= 1", "got 0"]),
    ("logging", "tracker", "mlflow", ["logging.tracker", "tensorboard", "'mlflow'"]),
    ("checkpoint", "save_every", -5, ["checkpoint.save_every", ">= 0", "-5"]),
    ("checkpoint", "keep", 0, ["checkpoint.keep", ">= 1"]),
    ("checkpoint", "save_final", "no", ["checkpoint.save_final", "true or false"]),
    ("checkpoint", "output_dir", "", ["checkpoint.output_dir", "non-empty"]),
    ("data", "seq_len", 1, ["data.seq_len", ">= 2"]),
    ("data", "seq_len", "64", ["data.seq_len", "without quotes"]),
    ("data", "too_long", "cut", ["data.too_long", "fail, truncate, drop"]),
    ("data", "shuffle", "no", ["data.shuffle", "true or false"]),
    ("parallel", "cp_size", 0, ["parallel.cp_size", ">= 1"]),
    ("parallel", "ulysses_size", 0, ["parallel.ulysses_size", ">= 1"]),
    ("parallel", "ulysses_size", "2", ["parallel.ulysses_size", "without quotes"]),
    ("model", "dtype", "fp16", ["model.dtype", "bf16, fp32"]),
    ("model", "attn_backend", "flash", ["model.attn_backend", "torch"]),
    ("model", "rope_theta", -1e6, ["model.rope_theta", "> 0"]),
    ("model", "max_position_embeddings", 0, ["model.max_position_embeddings", ">= 1"]),
    ("model", "sliding_window", 0, ["model.sliding_window", "keep, null"]),
    ("model", "rope_scaling", {"factor": 4.0}, ["model.rope_scaling", "rope_type"]),
    ("lora", "r", 0, ["lora.r", ">= 1"]),
    ("lora", "dropout", 1.0, ["lora.dropout", "< 1"]),
    ("lora", "alpha", "big", ["lora.alpha", "a number"]),
    ("lora", "adapter_dtype", "bf16", ["lora.adapter_dtype", "fp32, model", "'bf16'"]),
    ("lora", "target_modules", [], ["lora.target_modules", "non-empty list"]),
]


@pytest.mark.parametrize("section,key,value,words", BAD_VALUES, ids=lambda v: str(v)[:24])
def test_wrong_type_or_range_is_one_line_naming_key_and_value(tmp_path, section, key, value, words):
    raw = _raw(tmp_path, lora={"r": 4}) if section == "lora" else _raw(tmp_path)
    raw[section][key] = value
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    msg = str(info.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, f"{word!r} not in: {msg}"


def test_cross_field_checks(tmp_path):
    with pytest.raises(RecipeError, match=r"train.warmup_steps=5 is beyond train.max_steps=4"):
        recipe_from_dict(_raw(tmp_path, train={"warmup_steps": 5}))
    recipe_from_dict(_raw(tmp_path, train={"warmup_steps": 4}))  # == max_steps is fine
    recipe_from_dict(_raw(tmp_path, train={"warmup_steps": 5, "num_train_epochs": 3}))  # epochs decide
    no_ckpt = {"attention_checkpoint": "save", "gradient_checkpointing": False}
    needs = r"^train.attention_checkpoint=save needs train.gradient_checkpointing: true"
    with pytest.raises(RecipeError, match=needs):
        recipe_from_dict(_raw(tmp_path, train=no_ckpt))
    with pytest.raises(RecipeError, match=r"data.synthetic.min_len=100 is larger than data.seq_len=64"):
        recipe_from_dict(_raw(tmp_path, data={"path": None, "synthetic": {"min_len": 100}}))
    with pytest.raises(RecipeError, match=r"rope_type 'dynamic' is not exact with parallel.cp_size=2"):
        recipe_from_dict(
            _raw(
                tmp_path,
                parallel={"cp_size": 2},
                model={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            )
        )
    with pytest.raises(RecipeError, match="no 'data' section"):
        recipe_from_dict({"model": {"config": {}, "tokenizer": "demo"}})


def test_ulysses_size_divides_cp_size_and_the_query_heads(tmp_path, monkeypatch):
    """parallel.ulysses_size: checked at load against cp_size and (model.config) the query heads,
    each refusal naming the sizes that work; a pretrained model's heads with its config."""
    recipe = recipe_from_dict(_raw(tmp_path, parallel={"cp_size": 4, "ulysses_size": 2}))
    assert (recipe.parallel.cp_size, recipe.parallel.ulysses_size) == (4, 2)
    with pytest.raises(RecipeError, match=r"parallel.ulysses_size=3 does not divide cp_size=4.*\[1, 2, 4\]"):
        recipe_from_dict(_raw(tmp_path, parallel={"cp_size": 4, "ulysses_size": 3}))
    model = {"config": {**_raw(tmp_path)["model"]["config"], "num_attention_heads": 6, "hidden_size": 48}}
    with pytest.raises(
        RecipeError, match=r"query heads \(6\) are not divisible by ulysses_size=4.*\[1, 2\]$"
    ):
        recipe_from_dict(_raw(tmp_path, model=model, parallel={"cp_size": 8, "ulysses_size": 4}))
    from ringft.train.build import model_config

    raw = _raw(tmp_path, parallel={"cp_size": 4, "ulysses_size": 4})
    config = {k: v for k, v in raw["model"]["config"].items() if k != "num_attention_heads"}  # default 32
    recipe = recipe_from_dict({**raw, "model": {**raw["model"], "config": config}})
    assert model_config(recipe).num_attention_heads == 32  # 32 heads, ulysses 4: fine
    monkeypatch.setattr(recipe.parallel, "ulysses_size", 3)
    monkeypatch.setattr(recipe.parallel, "cp_size", 3)
    monkeypatch.setattr(recipe.data, "seq_len", 66)
    with pytest.raises(RecipeError, match=r"parallel.ulysses_size: query heads \(32\).*ulysses_size=3"):
        model_config(recipe)


def test_synthetic_section_is_typed_and_strict(tmp_path):
    raw = _raw(tmp_path, data={"path": None, "synthetic": {"num_examples": 8, "loss_on": "all"}})
    syn = recipe_from_dict(raw).data.synthetic
    assert (syn.num_examples, syn.loss_on, syn.min_len) == (8, "all", None)
    raw["data"]["synthetic"] = {"num_example": 8}  # a typo: no silent default any more
    with pytest.raises(RecipeError, match=r"data.synthetic.num_example.*valid keys.*num_examples"):
        recipe_from_dict(raw)
    raw["data"]["synthetic"] = {"loss_on": "prompt"}
    with pytest.raises(RecipeError, match=r"data.synthetic.loss_on must be one of answer, all"):
        recipe_from_dict(raw)
    raw["data"]["synthetic"] = {"num_examples": "8"}
    with pytest.raises(RecipeError, match=r"data.synthetic.num_examples must be an integer"):
        recipe_from_dict(raw)
    raw["data"]["synthetic"] = [8]
    with pytest.raises(RecipeError, match=r"'data.synthetic' must be a mapping"):
        recipe_from_dict(raw)


def test_overrides_parse_as_yaml_and_are_checked(tmp_path):
    raw = _raw(tmp_path)
    recipe = recipe_from_dict(apply_overrides(raw, ["--train.lr", "2e-5", "--train.max_steps", "7"]))
    assert recipe.train.lr == 2e-5 and recipe.train.max_steps == 7
    with pytest.raises(RecipeError, match=r"train.lr must be a number > 0, got 'fast'"):
        recipe_from_dict(apply_overrides(raw, ["--train.lr", "fast"]))
    nested = apply_overrides(
        _raw(tmp_path, data={"path": None, "synthetic": {}}), ["--data.synthetic.num_examples", "5"]
    )
    assert recipe_from_dict(nested).data.synthetic.num_examples == 5
    assert raw["train"]["lr"] == 1e-3  # the input mapping is not modified


def test_yaml_scientific_notation_is_a_number(tmp_path):
    """PyYAML reads ``2e-5`` (no dot) as a string; a float key accepts that spelling."""
    raw = _raw(tmp_path)
    raw["train"]["lr"] = "2e-5"
    assert recipe_from_dict(raw).train.lr == 2e-5


def test_launch_world_size_from_the_environment(tmp_path, monkeypatch):
    """Under accelerate / torchrun (WORLD_SIZE set), a cp_size that does not divide the launch is
    named first, not the seq_len divisibility it also breaks."""
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_raw(tmp_path, parallel={"cp_size": 3})))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"parallel.cp_size=3 does not divide the 2 launched processes"):
        load_recipe(path)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RecipeError, match=r"data.seq_len=64 is not divisible by 2 \* cp_size = 6"):
        load_recipe(path)


# -- recipe validation against the launch, and the CLI's error path ------------------------------


def _optimizer_betas(raw: dict) -> set[tuple[float, float]]:
    """The betas of every parameter group of the AdamW a one-process ``ringft train`` builds for ``raw``."""
    with in_process_front(raw) as run:
        return {tuple(group["betas"]) for group in run.trainer.create_optimizer().param_groups}


def test_valid_recipe_passes(tmp_path, data_path):
    """A valid recipe passes the launch checks, and its default AdamW betas (0.9, 0.95) (the long-
    context recipes' setting, not torch's (0.9, 0.999)) are the trainer optimizer's; a recipe's
    own betas replace them."""
    recipe = recipe_from_dict(_raw(tmp_path, parallel={"cp_size": 2}))
    validate(recipe, world_size=4)
    assert recipe.train.betas == (0.9, 0.95)
    assert _optimizer_betas(tiny_recipe(tmp_path / "default", data_path)) == {(0.9, 0.95)}
    own = tiny_recipe(tmp_path / "own", data_path, train={"betas": [0.8, 0.99]})
    assert _optimizer_betas(own) == {(0.8, 0.99)}


def test_unknown_key_names_the_key_and_the_valid_keys(tmp_path):
    raw = _raw(tmp_path)
    raw["train"]["max_step"] = 3
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    msg = str(info.value)
    assert "train.max_step" in msg and "max_steps" in msg and "micro_batch_size" in msg
    with pytest.raises(RecipeError, match="trainer"):
        recipe_from_dict({**_raw(tmp_path), "trainer": {}})


def test_seq_len_must_divide_by_twice_cp(tmp_path):
    with pytest.raises(RecipeError, match=r"seq_len=66 .*2 \* cp_size = 8.*72"):
        recipe_from_dict(_raw(tmp_path, data={"seq_len": 66}, parallel={"cp_size": 4}))


def test_missing_dataset_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(RecipeError, match="does not exist") as info:
        recipe_from_dict(_raw(tmp_path, data={"path": str(missing)}))
    assert str(missing) in str(info.value)


def test_cp_must_divide_world_size(tmp_path):
    recipe = recipe_from_dict(_raw(tmp_path, parallel={"cp_size": 2}))
    with pytest.raises(RecipeError, match=r"parallel.cp_size=2 does not divide the 3 launched processes"):
        validate(recipe, world_size=3)
    # cp 3 on 2 processes with a seq_len that 2 * 3 does not divide either: the launch is named first
    with pytest.raises(RecipeError, match=r"parallel.cp_size=3 does not divide the 2 launched processes"):
        recipe_from_dict(_raw(tmp_path, parallel={"cp_size": 3}), world_size=2)


def test_unsupported_model_type(tmp_path):
    from ringft.train.build import build_model

    raw = _raw(tmp_path, model={"model_type": "gpt2"})
    # Either the recipe check or (at the latest) building the model must refuse it, by name.
    with pytest.raises(RecipeError, match="gpt2"):
        build_model(recipe_from_dict(raw), vocab_size=300)


@pytest.mark.parametrize("which", ["both", "neither"])
def test_exactly_one_of_name_or_path_and_config(tmp_path, which):
    raw = _raw(tmp_path)
    if which == "both":
        raw["model"]["name_or_path"] = "some/model"
    else:
        del raw["model"]["config"]
    with pytest.raises(RecipeError, match="exactly one of model.name_or_path .* or model.config"):
        recipe_from_dict(raw)


@pytest.mark.timeout(120)
def test_cli_bad_recipe_exits_2_with_one_line(tmp_path):
    import yaml

    raw = _raw(tmp_path)
    raw["train"]["learning_rate"] = 1e-3
    bad = tmp_path / "BAD.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "ringft", "train", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringft train: error:") and "train.learning_rate" in lines[0]
    assert proc.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_fsdp_launch_without_gpu_is_refused_not_silently_dropped(tmp_path):
    """accelerate runs FSDP only on accelerators: without a GPU an FSDP launch config must fail
    with a clear error instead of training unsharded (what accelerate's cpu=True would do)."""
    import yaml

    recipe = tmp_path / "ok.yaml"
    recipe.write_text(yaml.safe_dump(_raw(tmp_path)))
    env = dict(os.environ, ACCELERATE_USE_FSDP="true")
    proc = subprocess.run(
        [sys.executable, "-m", "ringft", "train", str(recipe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "FSDP launch config needs GPUs" in proc.stderr and "cpu_2proc.yaml" in proc.stderr
