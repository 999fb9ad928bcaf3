"""recipes/smollm2_32k: SmolLM2-135M-Instruct (8K) extended to 32K. The 32K run needs a GPU; on CPU
we check that the recipes load through the typed schema, chain and point at existing files, that the
wrappers launch what they say, and that a few steps at 256 tokens train the real weights (CP = 2)
on data built by the recipe's own pipeline (pack.py + make_synthetic.py + mix_data.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ringft.train.recipe import RecipeError, load_recipe, validate
from ringft.utils.spawn import run_distributed
from tests.recipes.shell_stubs import check_command, run_script, scratch_root, script_namespace

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "recipes" / "smollm2_32k"
STAGES = [FOLDER / "stage1_16k.yaml", FOLDER / "stage2_32k.yaml"]
BEFORE_MODEL = "models/smollm2-135m-instruct"  # where prepare_data.sh puts the converted model
BASE_THETA = 100_000.0  # SmolLM2-135M-Instruct's RoPE theta, at 8K positions (tests/real_model.py)


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stages_load_chain_and_grow(tmp_path):
    recipes = [load_recipe(p, ["--data.path", str(tmp_path)]) for p in STAGES]
    for path, recipe in zip(STAGES, recipes, strict=True):
        with pytest.raises(RecipeError, match="does not exist"):  # as shipped: only the data is missing
            load_recipe(path)
        for world in (1, 2, 8):  # one GPU (run.sh's default), a ring of 2, the 8-GPU launch config
            validate(recipe, world_size=world)
        assert recipe.data.seq_len == recipe.model.max_position_embeddings
        assert recipe.data.seq_len % (2 * 2) == 0  # also shards on a ring of 2 (--parallel.cp_size 2)
        assert recipe.model.rope_scaling is None and recipe.train.chunked_loss
        raw = yaml.safe_load(path.read_text())
        assert raw["data"]["path"].startswith("data/smollm2-mix-")
        bare = [
            line
            for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":")
            if "#" not in line
        ]
        assert not bare, f"uncommented keys in {path.name}: {bare}"
    first, second = recipes
    assert first.model.name_or_path == BEFORE_MODEL
    assert second.model.name_or_path == f"{first.checkpoint.output_dir}/final"
    assert [r.data.seq_len for r in recipes] == [16384, 32768]
    assert BASE_THETA < first.model.rope_theta < second.model.rope_theta == 10 * BASE_THETA
    for recipe in recipes:  # 256K tokens per optimizer step on one GPU
        t = recipe.train
        assert t.micro_batch_size * t.grad_accum * recipe.data.seq_len == 1 << 18


def test_every_referenced_file_exists():
    for path in sorted(FOLDER.iterdir()):
        text = path.read_text()
        for ref in re.findall(r"(?<![\w/])(?:tests/)?(?:recipes|data_prep)/[\w./-]+\.(?:py|sh|yaml)", text):
            assert (REPO / ref).is_file(), f"{path.name} refers to missing {ref}"
        assert "/" + "work/" not in text and "../" + "shared" not in text
    for script in ("run.sh", "measure.sh", "prepare_data.sh"):  # (each is run: test_recipes.py)
        assert os.access(FOLDER / script, os.X_OK)


def test_prepare_data_builds_what_the_stages_read(tmp_path):
    """prepare_data.sh run with its Python calls recorded (tests/recipes/shell_stubs.py): it fetches
    the model into stage 1's model.name_or_path; per stage it packs the corpus and makes line
    records at that stage's seq_len with that model's tokenizer and mixes them into the stage's
    data.path. Run again, it keeps the folders that exist and only re-checks the model."""
    root = scratch_root(tmp_path)
    run = run_script(root, "smollm2_32k/prepare_data.sh", SOURCE="docs.jsonl", RECORDS="7")
    assert run.returncode == 0, run.stderr[-3000:]
    (fetch, model), *steps = [script_namespace(command) for command in run.commands]
    assert fetch == "data_prep/get_smollm2.py" and str(model.output) == BEFORE_MODEL
    assert len(steps) == 3 * len(STAGES)
    made = []
    for i, stage in enumerate(STAGES):
        (pack, packed), (make, lines), (mix, mixed) = steps[3 * i : 3 * i + 3]
        assert (pack, make, mix) == (
            "data_prep/pack.py",
            "data_prep/make_synthetic.py",
            "recipes/smollm2_32k/mix_data.py",
        )
        raw = yaml.safe_load(stage.read_text())
        assert packed.seq_len == lines.seq_len == raw["data"]["seq_len"]
        assert packed.tokenizer == lines.tokenizer == BEFORE_MODEL and packed.source == "docs.jsonl"
        assert lines.num_examples == 7 and lines.min_len < lines.seq_len
        assert (str(mixed.packed), str(mixed.lines)) == (str(packed.output), str(lines.output))
        assert str(mixed.output) == raw["data"]["path"]
        made += [packed.output, lines.output, mixed.output]
    for folder in made:
        (root / folder).mkdir(parents=True)
    again = run_script(root, "smollm2_32k/prepare_data.sh", SOURCE="docs.jsonl")
    assert again.returncode == 0 and [c[1] for c in again.commands] == ["data_prep/get_smollm2.py"]


def _dry_run(script: str, *args: str, **env: str) -> list[list[str]]:
    knobs = "STAGES LAUNCH_ARGS NUM_GPUS ACCELERATE ACCELERATE_CONFIG SIDES STYLES LENGTHS DEPTHS CASES"
    knobs += " BEFORE AFTER OUT"
    clean = {k: v for k, v in os.environ.items() if k not in knobs.split()}
    out = subprocess.run(
        ["bash", str(FOLDER / script), *args],
        env={**clean, "DRY_RUN": "1", "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def test_wrappers_launch_the_stages_and_the_measurement(tmp_path):
    """run.sh and measure.sh in DRY_RUN mode: the commands they print, and each one checked against
    what it calls (tests/recipes/shell_stubs.py: the launch config exists, accelerate knows the
    flags, the stage's recipe loads, eval-lines / compare accept their arguments)."""
    stages = _dry_run("run.sh", "--train.max_steps", "3")
    assert [c[c.index("train") + 1] for c in stages] == [str(p.relative_to(REPO)) for p in STAGES]
    for command in stages:
        assert command[:4] == ["accelerate", "launch", "--config_file", "recipes/accelerate/1node_8gpu.yaml"]
        assert command[4:6] == ["--num_processes", "1"]
        assert command[-3:] == ["--resume", "--train.max_steps", "3"]
        assert check_command(command[:-2], tmp_path) == "ringft train"  # (max_steps 3 < the warmup)
    assert _dry_run("run.sh", NUM_GPUS="2")[0][4:6] == ["--num_processes", "2"]

    from ringft.evals.lines.compare import parse_args as compare_args
    from ringft.evals.lines.task import parse_args as eval_args

    commands = _dry_run("measure.sh", "--cp-size", "1")
    evals = [c[c.index("eval-lines") + 1 :] for c in commands if "eval-lines" in c]
    assert len(evals) == 4 and len(commands) == 6  # before/after x 2 prompt styles, 2 comparisons
    for argv in evals:
        args = eval_args(argv)  # every flag is one eval-lines knows
        assert args.lengths == "4096,8192,16384,32768" and args.depths == "0,0.25,0.5,0.75,1"
        assert args.cp_size == 1 and args.prompt_style in ("ringft", "longchat")
    assert [eval_args(a).model for a in evals[:2]] == [BEFORE_MODEL, "outputs/smollm2_32k/stage2_32k/final"]
    before_only = _dry_run("measure.sh", SIDES="before")  # the base model, no comparison
    assert [eval_args(c[c.index("eval-lines") + 1 :]).model for c in before_only] == [BEFORE_MODEL] * 2
    checked = [check_command(c, tmp_path) for c in commands]
    assert checked == ["ringft eval-lines", "ringft eval-lines", "ringft.evals.compare"] * 2
    for command in commands:
        if "ringft.evals.compare" in command:
            runs = compare_args(command[command.index("ringft.evals.compare") + 1 :]).runs
            assert [Path(r).name for r in runs] in (
                ["before-ringft", "after-ringft"],
                ["before-longchat", "after-longchat"],
            )


def _train_worker(rank: int, world: int, recipe: str, overrides: list[str]) -> list[float]:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from ringft.train import train

    return train(load_recipe(recipe, overrides, world_size=world), progress=False).losses


@pytest.mark.timeout(240)
def test_a_few_steps_on_the_real_weights(tmp_path):
    """Stage 1 as shipped (theta 300K, 16K positions), shortened to 2 steps of 256 tokens with
    CP = 2, on the real SmolLM2 weights and a mix built by the recipe's data pipeline."""
    from tests.real_model import REAL_TEXT, smollm2_path

    model = smollm2_path()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": REAL_TEXT[i:] + REAL_TEXT[:i]}) + "\n" for i in (0, 9, 99)))
    packed, lines, mixed = tmp_path / "packed", tmp_path / "lines", tmp_path / "mix"
    pack = _module(REPO / "data_prep" / "pack.py")
    assert pack.main(f"--tokenizer {model} --source {docs} --seq-len 256 --output {packed}".split()) == 0
    synthetic = _module(REPO / "data_prep" / "make_synthetic.py")
    synthetic.main(
        f"--tokenizer {model} --num-examples 2 --seq-len 256 --min-len 200 --output {lines}".split()
    )
    mix = _module(FOLDER / "mix_data.py")
    assert mix.main(["--packed", str(packed), "--lines", str(lines), "--output", str(mixed)]) == 0
    assert mix.main(["--packed", str(packed), "--lines", str(lines), "--output", str(mixed)]) == 1  # exists

    import datasets

    rows = datasets.load_from_disk(str(mixed))
    assert rows.column_names == ["input_ids", "labels"] and len(rows) >= 4
    assert sum(-100 in r for r in rows["labels"]) == 2  # the two records: loss on the answer only

    out = tmp_path / "run"
    overrides = f"--model.name_or_path {model} --model.dtype fp32 --model.attn_backend torch".split()
    overrides += f"--data.path {mixed} --data.seq_len 256 --parallel.cp_size 2 --train.max_steps 2".split()
    overrides += "--train.warmup_steps 1 --train.grad_accum 1 --checkpoint.save_every 0".split()
    overrides += f"--checkpoint.output_dir {out} --logging.tracker none".split()
    losses = run_distributed(_train_worker, 2, str(STAGES[0]), overrides, timeout=200)[0]
    # A pretrained model on English text and line records is far below uniform (ln 49152 = 10.8);
    # random weights would sit at ~10.8.
    assert len(losses) == 2 and all(math.isfinite(x) and x < 0.6 * math.log(49152) for x in losses), losses
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 300000 and config["max_position_embeddings"] == 16384
