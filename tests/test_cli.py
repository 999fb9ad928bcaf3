"""The ``ringft`` command forgives a newcomer: ``--version``, a mistyped subcommand named with the
closest one, one token-count parser (``128k``, ``1M``) for every length flag, ``--key=value``
overrides, unknown recipe keys named with the key meant (Hugging Face names too), a folder given as
a recipe named as one, and ``--help`` in plain text (no reST)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from ringft.cli import COMMANDS, main
from ringft.ops.helptext import plain
from ringft.train.errors import RecipeError
from ringft.train.overrides import apply_overrides
from ringft.train.recipe import load_recipe, recipe_from_dict
from ringft.utils.values import parse_tokens, tokens_arg

REPO = Path(__file__).resolve().parents[1]


def test_version_and_unknown_subcommand(capsys):
    import ringft

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"ringft {ringft.__version__}"
    assert main(["plna"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'plna'" in err and "did you mean 'plan'?" in err and "\n" not in err.strip()
    assert main([]) == 2 and "usage: ringft" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text,tokens", [("4096", 4096), ("128k", 131072), ("128K", 131072), ("1M", 2**20), ("2m", 2**21)]
)
def test_token_counts(text, tokens):
    assert parse_tokens(text) == tokens == tokens_arg(text)


@pytest.mark.parametrize("text", ["4.5k", "k", "12kb", "", "1e5"])
def test_bad_token_counts_are_one_line(text):
    with pytest.raises(ValueError, match="not a whole number of tokens"):
        parse_tokens(text)
    with pytest.raises(argparse.ArgumentTypeError):
        tokens_arg(text)


def test_every_length_flag_takes_k(capsys):
    """plan, pack.py, make_synthetic.py and the eval commands read lengths through parse_tokens."""
    from ringft.evals.checks import parse_lengths
    from ringft.planner import plan_main

    assert parse_lengths("4k,128K,1M") == [4096, 131072, 2**20]
    argv = ["--model", "llama-3-8b", "--seq-len", "64k", "--gpus", "8", "--gpu-mem", "80", "--zero", "3"]
    assert plan_main([*argv, "--json"]) == 0
    assert '"seq_len": 65536' in capsys.readouterr().out
    for script, argv in (
        ("pack.py", ["--tokenizer", "demo", "--source", "x", "--output", "y", "--seq-len", "64k"]),
        ("make_synthetic.py", ["--tokenizer=demo", "--num-examples=1", "--output=y", "--seq-len=1M"]),
    ):
        spec = importlib.util.spec_from_file_location(script[:-3], REPO / "data_prep" / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        args = module.build_parser().parse_args(argv) if script == "pack.py" else module.parse_args(argv)
        assert args.seq_len == (65536 if script == "pack.py" else 2**20), script


BASE = {"model": {"config": {"hidden_size": 8}}, "data": {"synthetic": {}, "seq_len": 64}}


def test_overrides_take_key_equals_value():
    raw = apply_overrides(BASE, ["--train.max_steps=20", "--lora", "null", "--train.lr", "1e-4"])
    assert raw["train"] == {"max_steps": 20, "lr": "1e-4"} and raw["lora"] is None
    with pytest.raises(RecipeError, match="has no value"):
        apply_overrides(BASE, ["--train.max_steps"])


@pytest.mark.parametrize(
    "section,key,hint",
    [
        ("train", "lrr", "did you mean train.lr?"),
        ("train", "learnin_rate", "did you mean train.learning_rate?"),
        ("train", "eval_strategy", "eval_strategy is train.eval_every"),
        ("checkpoint", "learning_rate", "learning_rate is train.lr"),
        ("train", "output_dir", "did you mean checkpoint.output_dir?"),
        ("model", "gradient_accumulation_steps", "is train.grad_accum"),
        ("data", "per_device_train_batch_size", "is train.micro_batch_size"),
        ("data", "num_train_epochs", "did you mean train.num_train_epochs?"),
        ("model", "bf16", "model.dtype"),
        (None, "max_steps", "did you mean train.max_steps?"),
        (None, "trian", "did you mean train?"),
    ],
)
def test_unknown_keys_name_what_was_meant(section, key, hint):
    raw = {**BASE, section: {key: 1}} if section else {**BASE, key: 1}
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert hint in str(err.value) and "\n" not in str(err.value)


def test_hugging_face_names_in_their_section():
    raw = {
        **BASE,
        "train": {"learning_rate": 1e-4, "gradient_accumulation_steps": 2, "num_train_epochs": 3},
        "logging": {"report_to": "none"},
    }
    recipe = recipe_from_dict(raw)
    assert (recipe.train.lr, recipe.train.grad_accum, recipe.train.num_train_epochs) == (1e-4, 2, 3)
    assert recipe.logging.tracker == "none"
    with pytest.raises(RecipeError, match="train.learning_rate and train.lr are the same setting"):
        recipe_from_dict({**BASE, "train": {"learning_rate": 1e-4, "lr": 1e-4}})
    # a command-line override by the other name replaces the recipe's key
    given = {**BASE, "train": {"lr": 1e-4, "gradient_accumulation_steps": 2}}
    over = ["--train.learning_rate", "3e-4", "--train.grad_accum=4"]
    assert recipe_from_dict(apply_overrides(given, over)).train.lr == 3e-4
    assert recipe_from_dict(apply_overrides(given, over)).train.grad_accum == 4
    # report_to as Hugging Face writes it: a name or a list of one; several trackers refused by name
    spelled = ((["tensorboard"], "tensorboard"), ("wandb", "wandb"), ([], "none"), (None, "none"))
    for value, tracker in spelled:
        assert recipe_from_dict({**BASE, "logging": {"report_to": value}}).logging.tracker == tracker
    for value in (["tensorboard", "wandb"], "all"):
        with pytest.raises(RecipeError, match="logging.report_to=.* a recipe logs to one tracker"):
            recipe_from_dict({**BASE, "logging": {"report_to": value}})


def test_a_folder_given_as_a_recipe(tmp_path):
    (tmp_path / "stage1.yaml").write_text("model: {}\n")
    with pytest.raises(RecipeError, match="is a folder: give a recipe YAML file.*stage1.yaml"):
        load_recipe(tmp_path)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and f"ringft {command}" in out
    for rest in ("``", ":func:", ":mod:", ":class:", "see the module doc"):
        assert rest not in out, f"ringft {command} --help shows {rest!r}"


def test_plain_renders_rest():
    text = "``a`` :func:`b` :mod:`c.d` :class:`~e.F` `g` Example::\n\n    x"
    assert plain(text) == "a b c.d F g Example:\n\n    x"


def test_niah_depths_speak_of_needles(capsys):
    from ringft.evals.niah.task import main as niah_main

    assert niah_main(["--model", "none", "--depths", "1.5", "--no-progress"]) == 2
    captured = capsys.readouterr()
    message = captured.err + captured.out
    assert "needle" in message and "line" not in message.lower().replace("one line", "")
