"""docs/own-model.md's commands run: its ``ringft plan`` writes a recipe that loads (``load_recipe``)
with the layout the page's YAML shows; the page's YAML recipe passes the schema; its pack command is
one ``data_prep/pack.py`` accepts; its launch names a shipped config and the written recipe. (Its
Python block runs with every docs example, tests/test_readme_examples.py, on a tiny model.)"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import yaml

from ringft.planner import plan_main
from ringft.train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "own-model.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def _commands() -> list[list[str]]:
    lines = [code.replace("\\\n", " ") for code in _blocks("bash")]
    return [shlex.split(line) for block in lines for line in block.splitlines() if line.strip()]


def test_page_recipe_and_commands(tmp_path, monkeypatch, capsys):
    (block,) = _blocks("yaml")
    shown = yaml.safe_load(block)
    data = tmp_path / "data"
    data.mkdir()
    page_recipe = tmp_path / "page.yaml"
    page_recipe.write_text(block)
    recipe = load_recipe(page_recipe, ["--data.path", str(data)], world_size=8)
    assert recipe.model.rope_type == "yarn"

    monkeypatch.chdir(tmp_path)
    (plan,) = [c for c in _commands() if c[:2] == ["ringft", "plan"]]
    assert plan_main(plan[2:]) == 0, capsys.readouterr().out
    written = plan[plan.index("--write-recipe") + 1]
    assert f"wrote {written}" in capsys.readouterr().out
    planned = load_recipe(tmp_path / written, ["--data.path", str(data)], world_size=8)
    assert planned.parallel.cp_size == shown["parallel"]["cp_size"] == recipe.parallel.cp_size
    assert planned.data.seq_len == shown["data"]["seq_len"]
    assert planned.model.name_or_path == shown["model"]["name_or_path"]

    (pack,) = [c for c in _commands() if c[:2] == ["python", "data_prep/pack.py"]]
    spec = importlib.util.spec_from_file_location("pack", REPO / "data_prep" / "pack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args(pack[2:])
    assert args.seq_len == shown["data"]["seq_len"] and args.output == shown["data"]["path"]

    (launch,) = [c for c in _commands() if c[:2] == ["accelerate", "launch"]]
    assert (REPO / launch[launch.index("--config_file") + 1]).is_file()
    assert launch[-3:] == ["ringft", "train", written]
