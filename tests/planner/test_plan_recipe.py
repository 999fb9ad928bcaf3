"""``ringft plan --recipe / --write-recipe``: the recommended plan as a recipe that loads and passes
the recipe schema (``load_recipe``), names a shipped launch config, and is not overwritten without
``--force``; ``--attn-backend`` takes every backend; a model that is neither a preset nor a path
nor cached is refused at once, and config.json errors name the file and the missing keys."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from ringft.ops.backends import BACKENDS
from ringft.planner import plan_main
from ringft.train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
QWEN = ["--model", "Qwen/Qwen2.5-7B", "--seq-len", "128k", "--gpus", "8", "--gpu-mem", "80"]


def _recommended(capsys, argv):
    assert plan_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["recommended"]


@pytest.mark.parametrize(
    "extra,config",
    [
        (["--zero", "3"], "deepspeed_zero3.yaml"),
        (["--zero", "3", "--offload-optimizer", "--tiled-mlp"], "deepspeed_zero3_offload.yaml"),
        (["--lora", "--lora-bf16-adapters", "--tiled-norm-tokens=8k", "--rope-theta=4e6"], "1node_8gpu.yaml"),
    ],
)
def test_written_recipe_loads_and_matches_the_plan(tmp_path, capsys, extra, config):
    path = tmp_path / "r.yaml"
    assert plan_main([*QWEN, *extra, "--write-recipe", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    text = path.read_text()
    launch = re.search(r"^# Launch: accelerate launch --config_file (\S+) .* train (\S+)$", text, flags=re.M)
    assert launch and launch.group(1) == f"recipes/accelerate/{config}" and launch.group(2) == str(path)
    assert (REPO / launch.group(1)).is_file()
    data = tmp_path / "data"
    data.mkdir()
    recipe = load_recipe(path, ["--data.path", str(data)], world_size=8)  # the schema's checks
    best = _recommended(capsys, [*QWEN, *extra])
    assert recipe.parallel.cp_size == best["cp"] and recipe.data.seq_len == 131072
    assert recipe.model.name_or_path == "Qwen/Qwen2.5-7B"
    assert recipe.train.gradient_checkpointing and recipe.train.chunked_loss
    if "--tiled-mlp" in extra:
        assert recipe.train.tiled_mlp_tokens == 3584  # the hidden size: the planner's default tile
    if "--lora" in extra:
        assert recipe.lora is not None and recipe.lora.adapter_dtype == "model"
        assert recipe.train.tiled_norm_tokens == 8192 and recipe.model.rope_theta == 4e6
    else:
        assert recipe.lora is None


def test_recipe_is_not_overwritten_without_force(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("mine\n")
    assert plan_main([*QWEN, "--zero", "3", "--write-recipe", str(path)]) == 2
    assert "exists: pass --force" in capsys.readouterr().out and path.read_text() == "mine\n"
    assert plan_main([*QWEN, "--zero", "3", "--write-recipe", str(path), "--force"]) == 0
    assert path.read_text().startswith("# Written by: ringft plan")
    assert plan_main([*QWEN, "--zero", "3", "--recipe"]) == 0
    assert "parallel:\n  cp_size:" in capsys.readouterr().out


def test_nothing_fits_writes_no_recipe(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    assert plan_main([*QWEN[:-1], "4", "--write-recipe", str(path)]) == 1
    assert "no recipe to write" in capsys.readouterr().out and not path.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_is_planned(capsys, backend):
    best = _recommended(capsys, [*QWEN, "--zero", "3", "--attn-backend", backend])
    assert best["fits"]


def test_unknown_model_is_refused_at_once(capsys):
    start = time.perf_counter()
    assert plan_main(["--model", "NoSuchOrg/no-such-model-7b", *QWEN[2:]]) == 2
    out = capsys.readouterr().out
    assert time.perf_counter() - start < 10  # no hub round trips (offline they retry for ~20 s)
    assert "is not a preset" in out and "--config-json" in out and out.count("\n") == 1
    assert plan_main(["--model", "lama-3-8b", *QWEN[2:]]) == 2
    assert "did you mean llama-3-8b?" in capsys.readouterr().out


def test_config_json_errors_name_the_file(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {}\n")
    assert plan_main(["--config-json", str(recipe), *QWEN[2:]]) == 2
    out = capsys.readouterr().out
    assert str(recipe) in out and "config.json" in out and "Traceback" not in out
    partial = tmp_path / "config.json"
    partial.write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2}))
    assert plan_main(["--config-json", str(partial), *QWEN[2:]]) == 2
    out = capsys.readouterr().out
    assert str(partial) in out and "intermediate_size, vocab_size" in out and "NoneType" not in out
