"""The CPU demo: its recipes, the shipped base model they start from, and the before/after report.

Fast and local: nothing is trained here (retraining the base model is a benchmark,
recipes/demo/train_base.py). The shipped model is tied to its recipe by the recipe copy the
trainer exported next to the weights and by the weights' recorded SHA-256.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path

import pytest
import yaml

from ringft.data.line_retrieval.text import PREAMBLE, QUESTION_TEMPLATE, build_record_text, render_line
from ringft.data.line_retrieval.training import (
    LAST_LINE_SHARE,
    make_multi_question_example,
    make_repeat_dataset,
    make_repeat_example,
    make_synthetic_dataset,
)
from ringft.data.tokenizer import encode_prompt, load_tokenizer
from ringft.evals.lines import compare
from ringft.train.recipe import RecipeError, load_recipe, recipe_from_dict
from tests.recipes.shell_stubs import check_command, launched, parsed_by, run_script, scratch_root

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "recipes"
BASE_DIR = REPO_ROOT / "ringft" / "assets" / "demo_base"
WARMUP_RECIPE = RECIPES / "demo" / "base_induction.yaml"
BASE_RECIPE = RECIPES / "demo" / "base.yaml"
EXTEND_RECIPE = RECIPES / "demo" / "extend.yaml"
DEMO_SCRIPT = RECIPES / "demo_cpu.sh"
# SHA-256 of the shipped ringft/assets/demo_base/model.safetensors, printed by
# recipes/demo/train_base.py when it installs a retrained model (update both together).
SHIPPED_SHA256 = "7559d16a53976205f4d3bb4eb5fa0d69fe4f24ac66fdafbc9c5a7a266e72380d"


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
    warmup = load_recipe(WARMUP_RECIPE, world_size=1)
    base, extend = load_recipe(BASE_RECIPE, world_size=1), load_recipe(EXTEND_RECIPE, world_size=2)
    assert warmup.model.config is not None and warmup.data.synthetic.task == "repeat"
    assert warmup.model.tokenizer == "demo-lines"
    assert base.model.name_or_path == f"{warmup.checkpoint.output_dir}/final", "stage 0b starts from stage 0a"
    assert base.data.seq_len == warmup.data.seq_len == warmup.model.config["max_position_embeddings"]
    assert base.data.synthetic.task == "lines" and base.data.synthetic.questions > 1
    assert warmup.parallel.cp_size == base.parallel.cp_size == 1
    assert extend.model.name_or_path == BASE_DIR.relative_to(REPO_ROOT).as_posix()
    assert extend.parallel.cp_size == 2, "the demo extends on the ring (CP = 2)"
    assert extend.data.seq_len >= 4 * base.data.seq_len, "extension to at least 4x the trained length"
    assert extend.model.rope_theta > warmup.model.config["rope_theta"], "RoPE theta is raised"
    assert extend.model.max_position_embeddings == extend.data.seq_len
    assert extend.model.tokenizer is None, "the extension reads the base model's own tokenizer"


def test_shipped_base_matches_its_recipe():
    """The shipped weights are the ones the two base stages exported: the model config of stage 0a
    (recipes/demo/base_induction.yaml), the recipe of stage 0b (ringft_recipe.json, written by the
    trainer), the demo-lines tokenizer, and the recorded SHA-256."""
    if not (BASE_DIR / "model.safetensors").is_file():
        pytest.skip("ringft/assets/demo_base is not shipped yet: build it with recipes/demo/train_base.py")
    warmup = yaml.safe_load(WARMUP_RECIPE.read_text())
    config = json.loads((BASE_DIR / "config.json").read_text())
    for key, value in warmup["model"]["config"].items():
        if key == "rope_theta":
            assert config["rope_parameters"]["rope_theta"] == value
        else:
            assert config[key] == value, key
    tokenizer = load_tokenizer("demo-lines")
    assert config["vocab_size"] == len(tokenizer)
    shipped = load_tokenizer(str(BASE_DIR))
    assert shipped.get_vocab() == tokenizer.get_vocab()
    # Both through today's schema: keys added since the base was built (e.g. parallel.ulysses_size)
    # take their defaults on both sides, which are what the base was trained with.
    exported = recipe_from_dict(json.loads((BASE_DIR / "ringft_recipe.json").read_text())).to_dict()
    expected = recipe_from_dict(yaml.safe_load(BASE_RECIPE.read_text())).to_dict()
    for section in ("model", "data", "parallel", "train"):
        assert exported[section] == expected[section], section
    weights = BASE_DIR / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == SHIPPED_SHA256
    assert weights.stat().st_size < 8 * 2**20, "small enough to ship in the repository"


def test_demo_script_evaluates_before_and_after_on_the_ring(tmp_path):
    """demo_cpu.sh run for real with python / accelerate / pip recorded (tests/recipes/shell_stubs.py):
    it installs, evaluates the base model, extends it on the 2-process ring (CP = 2, the user's
    overrides passed on), evaluates the extension's export on the same grid, then compares the
    two; every command is one its program accepts. Without the base model: one line, exit 2,
    nothing run."""
    from ringft.evals.lines.task import main as eval_main

    root = scratch_root(tmp_path)
    run = run_script(root, DEMO_SCRIPT.name, "--train.max_steps", "50")
    assert run.returncode == 0, run.stderr[-3000:]
    checked = [check_command(c, tmp_path) for c in run.commands]
    evals = ["ringft eval-lines", "ringft train", "ringft eval-lines", "ringft.evals.compare"]
    assert checked == ["venv", "pip", "pip", "pip", *evals]
    assert run.commands[3][-2:] == ["-e", str(root)]  # ringft alone: no test extra for the demo
    (before, extend, after), compared = [launched(c) for c in run.commands[4:7]], run.commands[7]
    configs = {launch.config_file for launch, _ in (before, extend, after)}
    assert configs == {"recipes/accelerate/cpu_2proc.yaml"}
    assert extend[1][1:4] == ["train", str(EXTEND_RECIPE.relative_to(REPO_ROOT)), "--checkpoint.output_dir"]
    out = extend[1][4]
    assert extend[1][5:] == ["--train.max_steps", "50"]  # the script's arguments reach the recipe
    grids = [parsed_by(eval_main, args[2:]) for _, args in (before, after)]
    assert [g.model for g in grids] == [BASE_DIR.relative_to(REPO_ROOT).as_posix(), f"{out}/final"]
    assert all(g.prompt_style == "ringft" for g in grids)  # the wording the base model was trained on
    assert len({(g.lengths, g.depths, g.cases) for g in grids}) == 1
    lengths = [int(x) for x in grids[0].lengths.split(",")]  # L and 4L: inside each model's length
    extension = load_recipe(EXTEND_RECIPE, world_size=2)
    assert max(lengths) <= extension.data.seq_len and min(lengths) <= extension.data.seq_len // 4
    runs = compare.parse_args(compared[compared.index("ringft.evals.compare") + 1 :])
    assert runs.runs == [g.output for g in grids] and runs.figure

    (root / "ringft" / "assets" / "demo_base" / "model.safetensors").unlink()
    missing = run_script(root, DEMO_SCRIPT.name)
    assert missing.returncode == 2 and missing.commands == []
    assert "demo_base is missing" in missing.stderr and "train_base.py" in missing.stderr


# -- multi-question training records ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["demo", "demo-lines"])
def tok(request):
    return load_tokenizer(request.param)


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
    assert answers.count(tok.eos_token_id) >= 1 and len(answers) < len(ex["labels"]) // 2
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


def _asked_lines(tok, ex) -> tuple[int, list[int]]:
    """(lines in the record, index of the line each question asks), read back from the tokens."""
    text = tok.decode(ex["input_ids"], skip_special_tokens=True)
    lines = [line.split(" ")[1].rstrip(":") for line in text.splitlines() if line.startswith("line ")]
    prefix, suffix = QUESTION_TEMPLATE.split("{name}")
    asked = [lines.index(part.split(suffix)[0]) for part in text.split(prefix)[1:]]
    return len(lines), asked


def test_questions_ask_the_last_line_as_often_as_the_eval_does():
    """The first question asks the last line with probability LAST_LINE_SHARE + (1 - share) / n (the
    eval's depth 1.0 is one of five depths); later questions draw lines with replacement, so the
    number just before a question is sometimes the answer. Binomial bounds at 5 sigma."""
    tok = load_tokenizer("demo-lines")
    records = [_asked_lines(tok, make_multi_question_example(tok, 128, s, questions=8)) for s in range(400)]
    first_last = sum(asked[0] == n - 1 for n, asked in records)
    expected = sum(LAST_LINE_SHARE + (1 - LAST_LINE_SHARE) / n for n, _ in records)
    assert abs(first_last - expected) < 5 * math.sqrt(expected)
    repeats = sum(b == a for n, asked in records if n > 1 for a, b in zip(asked, asked[1:]))
    pairs = sum(len(asked) - 1 for n, asked in records if n > 1)
    assert repeats > 0 and pairs > 100


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


# -- the demo-lines tokenizer and the induction warm-up records -----------------------------------


def test_demo_lines_tokenizer_makes_template_pieces_and_number_chunks_single_tokens():
    demo, lines = load_tokenizer("demo"), load_tokenizer("demo-lines")
    assert lines.convert_ids_to_tokens(list(range(len(demo)))) == demo.convert_ids_to_tokens(
        list(range(len(demo)))
    )
    line = render_line("brave-tiger", 31337)
    ids = lines(line, add_special_tokens=False)["input_ids"]
    pieces = [lines.decode([i]) for i in ids]
    assert pieces == ["line", " brave", "-", "tiger: REGISTER_CONTENT is <", "313", "37", ">\n"]
    for number, chunks in ((7, ["7"]), (40001, ["400", "01"]), (1234, ["123", "4"]), (50000, ["500", "00"])):
        got = [lines.decode([i]) for i in lines(f" {number}", add_special_tokens=False)["input_ids"]]
        assert got == [" ", *chunks]
    record = build_record_text(["brave-tiger", "calm-turtle"], [31337, 12], 1, "ringft")
    ids = lines(record)["input_ids"]
    assert len(ids) == 1 + 1 + 7 + 6 + 4  # BOS, header, 2 lines, question
    assert lines.decode(ids[-1:]) == "turtle? Answer with the number."
    assert lines.decode(lines(record)["input_ids"], skip_special_tokens=True) == record


def test_multi_question_records_fill_the_length_with_short_lines():
    """With 6-7-token lines a record holds more lines than the first guess of the line pool (seq_len / 15)."""
    tok = load_tokenizer("demo-lines")
    most = 0
    for seed in range(40):
        ex = make_multi_question_example(tok, 512, seed, questions=1)
        assert len(ex["input_ids"]) <= 512
        most = max(most, sum(t == tok.convert_tokens_to_ids("line") for t in ex["input_ids"]))
    assert most > 512 // 15


def test_repeat_examples_copy_a_random_run():
    tok = load_tokenizer("demo-lines")
    for seed in range(20):
        ex = make_repeat_example(tok, 128, seed)
        ids, labels = ex["input_ids"], ex["labels"]
        m = (len(ids) - 1) // 2
        assert ids[0] == tok.bos_token_id and len(ids) == len(labels) == 1 + 2 * m <= 128 and m >= 8
        assert ids[1 : 1 + m] == ids[1 + m :] and not set(ids[1:]) & set(tok.all_special_ids)
        assert labels[: m + 2] == [-100] * (m + 2) and labels[m + 2 :] == ids[m + 2 :]
    assert make_repeat_example(tok, 128, 3) == make_repeat_example(tok, 128, 3)
    assert (
        make_repeat_dataset(tok, 3, 128, seed=0)["input_ids"][2]
        != make_repeat_dataset(tok, 3, 128, seed=1)["input_ids"][2]
    )
    with pytest.raises(ValueError, match="too short"):
        make_repeat_example(tok, 16, 0)


def test_repeat_task_is_checked_in_the_recipe():
    raw = yaml.safe_load((RECIPES / "demo" / "base_induction.yaml").read_text())
    assert recipe_from_dict(raw).data.synthetic.task == "repeat"
    for key, value in (("loss_on", "all"), ("questions", 4), ("min_len", 64)):
        bad = yaml.safe_load((RECIPES / "demo" / "base_induction.yaml").read_text())
        bad["data"]["synthetic"][key] = value
        with pytest.raises(RecipeError, match="task=repeat makes its own records"):
            recipe_from_dict(bad)
    bad["data"]["synthetic"] = {"task": "copy"}
    with pytest.raises(RecipeError, match="data.synthetic.task"):
        recipe_from_dict(bad)
