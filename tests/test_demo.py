"""The CPU demo: its recipes, the shipped base model they start from, and the before/after report.

Fast and local: nothing is trained here (retraining the base model is a benchmark,
benchmarks/train_demo_base.py). The shipped model is tied to its recipe by the recipe copy the
trainer exported next to the weights and by the weights' recorded SHA-256.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from ringft.data.synthetic import make_multi_question_example, make_synthetic_dataset
from ringft.demo_tokenizer import load_tokenizer
from ringft.evals import compare
from ringft.lines.text import PREAMBLE, QUESTION_TEMPLATE, build_record_text, encode_prompt
from ringft.train.recipe import RecipeError, load_recipe, recipe_from_dict

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "recipes"
BASE_DIR = REPO_ROOT / "ringft" / "assets" / "demo_base"
BASE_RECIPE = RECIPES / "demo" / "base.yaml"
EXTEND_RECIPE = RECIPES / "demo" / "extend.yaml"
DEMO_SCRIPT = RECIPES / "demo" / "context_extension.sh"
# SHA-256 of the shipped ringft/assets/demo_base/model.safetensors, printed by
# benchmarks/train_demo_base.py when it installs a retrained model (update both together).
SHIPPED_SHA256 = "TO-BE-FILLED"


# -- compare.py --------------------------------------------------------------------------------


def write_summary(folder: Path, rows: list[tuple[int, float, int, float]], extra: bool = True) -> Path:
    """An eval-lines style summary.csv with (length, depth, cases, accuracy) rows; ``extra`` adds
    columns compare.py must ignore, in another order than eval-lines writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "summary.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        head = ["accuracy", "depth", "length", "cases"] + (["mean_answer_prob", "new_col"] if extra else [])
        writer.writerow(head)
        for length, depth, cases, acc in rows:
            writer.writerow([acc, depth, length, cases] + ([0.5, "x"] if extra else []))
    return folder


BEFORE = [(256, 0.0, 10, 1.0), (256, 1.0, 10, 0.9), (1024, 0.0, 10, 0.0), (1024, 1.0, 10, 0.2)]
AFTER = [(256, 0.0, 10, 1.0), (256, 1.0, 10, 1.0), (1024, 0.0, 10, 0.8), (1024, 1.0, 10, 1.0)]


def test_compare_reads_columns_by_name_and_pools_depths(tmp_path):
    before = compare.read_summary(write_summary(tmp_path / "before", BEFORE))
    assert before[(1024, 1.0)] == compare.Cell(cases=10, accuracy=0.2)
    assert compare.accuracy_by_length(before) == {256: (pytest.approx(0.95), 20), 1024: (0.1, 20)}
    # case-weighted: a cell with more cases counts more
    uneven = compare.read_summary(write_summary(tmp_path / "u", [(64, 0.0, 30, 1.0), (64, 1.0, 10, 0.0)]))
    assert compare.accuracy_by_length(uneven)[64] == (0.75, 40)


def test_compare_table(tmp_path):
    runs = [
        ("base", compare.read_summary(write_summary(tmp_path / "b", BEFORE))),
        ("extended", compare.read_summary(write_summary(tmp_path / "a", AFTER, extra=False))),
    ]
    table = compare.comparison_table(runs).splitlines()
    assert table[0] == "| prompt tokens | base | extended | cases per run |"
    assert table[2] == "| 256 | 0.95 | 1.00 | 20 |"
    assert table[3] == "| 1024 | 0.10 | 0.90 | 20 |"


def test_compare_missing_column_and_file(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.csv").write_text("length,depth,cases\n256,0,4\n")
    with pytest.raises(ValueError, match="no column.*accuracy"):
        compare.read_summary(bad)
    with pytest.raises(ValueError, match="no eval summary"):
        compare.read_summary(tmp_path / "nothing")


def test_compare_cli_writes_one_figure(tmp_path):
    before = write_summary(tmp_path / "before", BEFORE)
    after = write_summary(tmp_path / "after", AFTER[:3])  # a missing cell is drawn as "-"
    fig, md = tmp_path / "out" / "before_after.png", tmp_path / "table.md"
    rc = compare.main(
        [
            str(before),
            str(after / "summary.csv"),
            "--labels",
            "before",
            "after",
            "--figure",
            str(fig),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1024 | 0.10 | 0.80 | 20/10 |" in md.read_text()
    assert compare.main([str(before), "--labels", "a", "b"]) == 2  # one label per run


# -- the recipes -------------------------------------------------------------------------------


def test_demo_recipes_load_and_chain():
    base, extend = load_recipe(BASE_RECIPE, world_size=1), load_recipe(EXTEND_RECIPE, world_size=2)
    assert base.model.config is not None and base.parallel.cp_size == 1
    assert extend.model.name_or_path == BASE_DIR.relative_to(REPO_ROOT).as_posix()
    assert extend.parallel.cp_size == 2, "the demo extends on the ring (CP = 2)"
    assert extend.data.seq_len >= 4 * base.data.seq_len, "extension to at least 4x the trained length"
    assert extend.model.rope_theta > base.model.config["rope_theta"], "RoPE theta is raised"
    assert extend.model.max_position_embeddings == extend.data.seq_len
    for recipe in (base, extend):
        assert recipe.model.tokenizer == "demo" and recipe.data.synthetic.questions > 1


def test_shipped_base_matches_its_recipe():
    """The shipped weights are the ones recipes/demo/base.yaml exported: same config, same recipe
    (ringft_recipe.json, written by the trainer), and the recorded SHA-256."""
    if not (BASE_DIR / "model.safetensors").is_file():
        pytest.skip("ringft/assets/demo_base is not shipped yet: build it with benchmarks/train_demo_base.py")
    raw = yaml.safe_load(BASE_RECIPE.read_text())
    config = json.loads((BASE_DIR / "config.json").read_text())
    for key, value in raw["model"]["config"].items():
        if key == "rope_theta":
            assert config["rope_parameters"]["rope_theta"] == value
        else:
            assert config[key] == value, key
    assert config["vocab_size"] == len(load_tokenizer("demo"))
    exported = json.loads((BASE_DIR / "ringft_recipe.json").read_text())
    expected = recipe_from_dict(raw).to_dict()
    for section in ("model", "data", "parallel", "train"):
        assert exported[section] == expected[section], section
    weights = BASE_DIR / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == SHIPPED_SHA256
    assert weights.stat().st_size < 8 * 2**20, "small enough to ship in the repository"


def test_demo_script_evaluates_before_and_after_on_the_ring():
    script = DEMO_SCRIPT.read_text()
    assert "--prompt-style ringft" in script  # the wording the base model was trained on
    calls = [line for line in script.splitlines() if line.startswith("eval_lines ")]
    assert [c.split()[1] for c in calls] == ['"$BASE"', '"$OUT/extend/final"']  # before and after
    assert "train recipes/demo/extend.yaml" in script and "cpu_2proc.yaml" in script
    assert "ringft.evals.compare" in script and "--figure" in script


# -- multi-question training records ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def test_multi_question_record_prefix_is_an_eval_record(tok):
    """Up to its first answer, a training record is token for token the eval's prompt."""
    for seed in range(20):
        ex = make_multi_question_example(tok, 256, seed, questions=8)
        ids, labels = ex["input_ids"], ex["labels"]
        assert len(ids) == len(labels) <= 256
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.startswith(tok.bos_token + PREAMBLE)
        first = next(i for i, v in enumerate(labels) if v != -100)
        prompt = tok.decode(ids[1:first])
        body, question = prompt[len(PREAMBLE) :].split(QUESTION_TEMPLATE.split("{")[0])
        lines = body.splitlines()
        names = [line.split(" ")[1].rstrip(":") for line in lines]
        numbers = [int(line.split("<")[1].rstrip(">")) for line in lines]
        asked = names.index(question.split("?")[0])
        expected = encode_prompt(tok, build_record_text(names, numbers, asked, "ringft"))
        assert ids[:first] == expected  # pieces tokenized apart == the whole prompt tokenized
        answer = tok(f" {numbers[asked]}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert labels[first : first + len(answer)] == answer


def test_multi_question_labels_and_determinism(tok):
    ex = make_multi_question_example(tok, 256, 7, questions=8)
    assert ex == make_multi_question_example(tok, 256, 7, questions=8)
    answers = [v for v in ex["labels"] if v != -100]
    assert answers.count(tok.eos_token_id) >= 1 and len(answers) < len(ex["labels"]) // 3
    wide = make_multi_question_example(tok, 256, 7, questions=8, loss_on="questions")
    assert wide["input_ids"] == ex["input_ids"]
    assert sum(v != -100 for v in wide["labels"]) > len(answers)
    one = make_multi_question_example(tok, 256, 7, questions=1)
    assert one["labels"].count(tok.eos_token_id) == 1
    ds = make_synthetic_dataset(tok, 4, 512, seed=3, questions=4)
    assert all(len(r) <= 512 for r in ds["input_ids"])
    with pytest.raises(ValueError, match="min_len unset"):
        make_synthetic_dataset(tok, 2, 256, seed=0, questions=4, min_len=128)
    with pytest.raises(ValueError, match="needs questions > 1"):
        make_synthetic_dataset(tok, 2, 256, seed=0, loss_on="questions")


def test_questions_option_is_checked_in_the_recipe():
    raw = yaml.safe_load(BASE_RECIPE.read_text())
    raw["data"]["synthetic"]["questions"] = 0
    with pytest.raises(RecipeError, match=r"data.synthetic.questions must be an integer >= 1"):
        recipe_from_dict(raw)
    raw["data"]["synthetic"].update(questions=4, loss_on="all")
    with pytest.raises(RecipeError, match=r"data.synthetic.questions=4 .* loss_on"):
        recipe_from_dict(raw)
    raw["data"]["synthetic"].update(questions=1, loss_on="questions")
    with pytest.raises(RecipeError, match=r"loss_on=questions needs data.synthetic.questions > 1"):
        recipe_from_dict(raw)
