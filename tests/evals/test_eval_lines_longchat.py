"""LongChat compatibility: its prompt strings verbatim, its scoring rule, its test-case files."""

from __future__ import annotations

import copy
import json
import random

import pytest

from ringft.data.line_retrieval import build_record_text
from ringft.data.tokenizer import load_demo_tokenizer
from ringft.evals.lines.cases import make_line_case
from ringft.evals.lines.files import CasesFileError, load_cases_jsonl
from ringft.evals.lines.scoring import (
    extract_answer,
    extract_first_integer,
    extract_last_integer,
    score_answer,
)

# LongChat's strings (lm-sys/LongChat, longeval/utils.py), typed here independently of ringft's
# constants so that a change to either is caught.
HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' "
    "and contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line "
    "index, memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you "
    "to retrieve the corresponding <REGISTER_CONTENT> of a certain line index. Now the record "
    "start:\n\n"
)
QUESTION = "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {}? I need the number."


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


@pytest.fixture(scope="module")
def chat_tok(tok):
    chat = copy.deepcopy(tok)
    chat.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    return chat


def test_longchat_prompt_style_is_verbatim():
    text = build_record_text(["brave-otter", "calm-apple"], [7, 31337], 1, "longchat")
    body = "line brave-otter: REGISTER_CONTENT is <7>\nline calm-apple: REGISTER_CONTENT is <31337>\n"
    assert text == HEADER + body + QUESTION.format("calm-apple")


def test_longchat_case_fits_and_asks_the_right_line(tok, chat_tok):
    case = make_line_case(tok, 600, 0.5, seed=4, prompt_style="longchat")
    assert case.prompt.startswith(HEADER) and case.prompt.endswith(QUESTION.format(case.target_line))
    assert f"line {case.target_line}: REGISTER_CONTENT is <{case.answer}>\n" in case.prompt
    assert case.prompt_style == "longchat" and case.num_tokens <= 600
    chat = make_line_case(chat_tok, 600, 0.5, seed=4, prompt_style="longchat")
    assert chat.prompt.startswith("<s>[user] " + HEADER)  # the whole prompt in one user turn
    assert chat.prompt.endswith(QUESTION.format(chat.target_line) + "\n[assistant] ")


def test_scoring_rules():
    sentence = "The <REGISTER_CONTENT> of line curious-pigeon is 20854."
    for text in (sentence, " 20854</s>", "<20854>", "line brave-otter: REGISTER_CONTENT is <20854>"):
        assert extract_first_integer(text) == extract_last_integer(text) == 20854  # they agree
        assert score_answer(text, 20854, "longchat") and score_answer(text, "20854", "first-int")
    # Where they differ: several numbers, grouped digits (LongChat reads "\d+" only).
    assert extract_last_integer("12 or 123") == 123 and extract_first_integer("12 or 123") == 12
    assert extract_last_integer("20,854") == 854 and extract_first_integer("20,854") == 20854
    assert extract_last_integer("no digits") is None and not score_answer("none", 1, "longchat")
    assert extract_last_integer("00123") == 123
    assert extract_last_integer("٣ then") == 3  # like LongChat's re.findall("\d+"): Unicode digits
    with pytest.raises(ValueError, match="scoring 'last'"):
        extract_answer("1", "last")


def longchat_row(num_lines: int, seed: int, trailing_space: bool = False) -> dict:
    """A row in the format of LongChat's ``<N>_lines.jsonl`` (its generator's fields and layout)."""
    rng = random.Random(seed)
    adjectives, nouns = (
        ("torpid", "grass", "oval", "tall", "mundane", "racial"),
        ("kid", "whip", "nutmeg", "eraser", "beech", "fedora"),
    )
    keys = rng.sample([f"{a}-{n}" for a in adjectives for n in nouns], num_lines)
    lines = [f"line {k}: REGISTER_CONTENT is <{rng.randint(1, 50000)}>\n" for k in keys]
    position = rng.randrange(num_lines)
    number = int(lines[position].rsplit("<", 1)[1].split(">")[0])
    prompt = HEADER + "".join(lines) + QUESTION.format(keys[position]) + (" " if trailing_space else "")
    row = {"random_idx": [keys[position], position], "expected_number": number, "num_lines": num_lines}
    if trailing_space:  # the 200..680-line files also carry these two fields
        row.update(token_size=4803, prompt_length=-1)
    row.update(correct_line=lines[position], prompt=prompt)
    return row


def test_reads_longchat_testcase_files(tmp_path, tok, chat_tok):
    rows = [longchat_row(12, 0, trailing_space=True), longchat_row(12, 1), longchat_row(30, 2)]
    path = tmp_path / "12_lines.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = load_cases_jsonl(path, chat_tok)
    assert len(cases) == 3
    for case, row, number in zip(cases, rows, (1, 2, 3), strict=True):
        assert case.prompt == "<s>[user] " + row["prompt"] + "\n[assistant] "  # verbatim, one turn
        assert case.answer == str(row["expected_number"]) and case.target_line == row["random_idx"][0]
        assert case.target_index == row["random_idx"][1] and case.num_lines == row["num_lines"]
        assert case.depth == case.actual_depth == row["random_idx"][1] / (row["num_lines"] - 1)
        assert case.source == case.prompt_style == "longchat" and case.case_index == number
        assert case.num_tokens == case.length == len(case.input_ids(chat_tok))
    raw = load_cases_jsonl(path, tok)[1]  # no chat template: the prompt as it is
    assert raw.prompt == rows[1]["prompt"] and not raw.chat_template


def test_longchat_file_errors_name_the_line(tmp_path, tok):
    good = json.dumps(longchat_row(5, 0)) + "\n"
    wrong_number = longchat_row(5, 1)
    wrong_number["expected_number"] += 1
    wrong_position = longchat_row(5, 2)
    wrong_position["random_idx"][1] = (wrong_position["random_idx"][1] + 1) % 5
    missing = {k: v for k, v in longchat_row(5, 3).items() if k != "correct_line"}
    for bad, message in (
        (wrong_number, "does not hold key"),
        (wrong_position, "is not the correct_line"),
        (missing, "lacks field(s) ['correct_line']"),
        ("[1, 2]", "expected a JSON object"),
        ('{"expected_number": 1', "line 4: Expecting"),
    ):
        path = tmp_path / "cases.jsonl"
        text = bad if isinstance(bad, str) else json.dumps(bad)
        path.write_text(good + "\n" + good + text + "\n" + good)  # blank line 2 counts
        with pytest.raises(CasesFileError, match="line 4: ") as err:
            load_cases_jsonl(path, tok)
        assert str(path) in str(err.value) and message in str(err.value), err.value
    with pytest.raises(CasesFileError, match="needs a tokenizer"):
        load_cases_jsonl(path)
