"""eval-lines' answer scoring and case files (``ringft.evals.lines.scoring`` / ``.files``), and the
``data_prep/make_lines_eval.py`` script that writes them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ringft.data.tokenizer import load_demo_tokenizer
from ringft.evals.lines.cases import LineCase, make_line_cases
from ringft.evals.lines.files import load_cases_jsonl, save_cases_jsonl
from ringft.evals.lines.scoring import extract_first_integer, score_answer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


@pytest.mark.timeout(120)
def test_extract_first_integer():
    assert extract_first_integer("no number here") is None
    assert extract_first_integer("") is None
    assert extract_first_integer("12 and 34") == 12
    assert extract_first_integer("The answer is <00123>.") == 123
    assert extract_first_integer("line42 says 7") == 42  # digits glued to letters count
    assert extract_first_integer("-17") == 17  # sign ignored
    assert extract_first_integer("12,345 apples") == 12345  # thousands separators
    assert extract_first_integer("1,234,567") == 1234567
    assert extract_first_integer("12,34") == 12  # not a thousands group
    assert extract_first_integer("12,3456") == 12
    assert extract_first_integer("3.75") == 3
    assert extract_first_integer("١٢٣ 5") == 5  # only ASCII digits


@pytest.mark.timeout(120)
def test_score_answer():
    assert score_answer(" 31337</s>", "31337")
    assert score_answer("The REGISTER_CONTENT is <31337>.", 31337)
    assert score_answer("00123", "123")
    assert not score_answer("I do not know.", "123")
    assert not score_answer("12 or 123", "123")  # judged on the first number only
    assert not score_answer("1234", "123")
    assert score_answer("line brave-otter: REGISTER_CONTENT is <77>", "77")  # names: no digits


@pytest.mark.timeout(120)
def test_jsonl_round_trip(tok, tmp_path):
    cases = make_line_cases(tok, [400], [0.0, 0.5], 2, seed=1)
    path = tmp_path / "sub" / "cases.jsonl"
    save_cases_jsonl(cases, path)
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(cases)
    loaded = load_cases_jsonl(path)
    assert loaded == cases
    assert LineCase.from_json(cases[0].to_json()) == cases[0]
    assert LineCase.from_json(cases[0].to_dict()) == cases[0]
    extra = dict(cases[0].to_dict(), unknown_field=1)
    assert LineCase.from_json(json.dumps(extra)) == cases[0]


@pytest.mark.timeout(120)
def test_make_lines_eval_cli(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_lines_eval", REPO / "data_prep" / "make_lines_eval.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cases.jsonl"
    mod.main(
        [
            "--tokenizer",
            "demo",
            "--lengths",
            "300,1k",
            "--depths",
            "0,1",
            "--cases",
            "2",
            "--seed",
            "0",
            "--output",
            str(out),
        ]
    )
    cases = load_cases_jsonl(out)
    assert len(cases) == 8
    assert {c.length for c in cases} == {300, 1024}
    assert all(c.num_tokens <= c.length for c in cases)
