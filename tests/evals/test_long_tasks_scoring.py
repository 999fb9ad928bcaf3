"""Scoring of the long-context tasks against hand-made outputs, RULER's effective length, the task
registry's errors and the sentence splitter (pure Python, no tokenizer)."""

from __future__ import annotations

import math

import pytest

from ringft.evals.long_tasks import (
    DEFAULT_THRESHOLD,
    NIAH_TASKS,
    RULER_TASKS,
    TASKS,
    aggregate_score,
    average_over_tasks,
    check_threshold,
    effective_length,
    format_length,
    get_task,
    passkey_match,
    postprocess_prediction,
    resolve_tasks,
    score_prediction,
    split_sentences,
    string_match_all,
    string_match_part,
)
from ringft.evals.long_tasks.scoring import ruler_string_match_all, ruler_string_match_part


def _ruler_all(preds, refs):
    """RULER's string_match_all, as written in scripts/eval/synthetic/constants.py (the oracle)."""
    score = sum(
        [
            sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
            for pred, ref in zip(preds, refs)
        ]
    )
    return round(score / len(preds) * 100, 2)


def _ruler_part(preds, refs):
    score = sum(
        [max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) for pred, ref in zip(preds, refs)]
    )
    return round(score / len(preds) * 100, 2)


PREDS = [
    " 1234567. Also 7654321.",
    "The special magic NUMBER is 1234567",
    "the words are: Apple, banana",
    "nothing here",
    "ABCDE, fghij and KLMNO",
    "",
]
REFS = [
    ["1234567", "7654321"],
    ["1234567"],
    ["apple", "Banana", "cherry"],
    ["42"],
    ["abcde", "FGHIJ", "klmno", "PQRST"],
    ["x"],
]


def test_string_match_all_hand_made():
    """Fractions found, case-insensitively, and the batch value equals RULER's own formula."""
    expected = [1.0, 1.0, 2 / 3, 0.0, 0.75, 0.0]
    assert [string_match_all(p, r) for p, r in zip(PREDS, REFS)] == pytest.approx(expected)
    assert string_match_all("aPPle pie", ["apple"]) == 1.0
    assert string_match_all("12345", ["123456"]) == 0.0  # a reference must appear whole
    assert ruler_string_match_all(PREDS, REFS) == _ruler_all(PREDS, REFS) == round(sum(expected) / 6 * 100, 2)


def test_string_match_part_hand_made():
    """Any reference found counts the sample fully (RULER's QA metric)."""
    assert [string_match_part(p, r) for p, r in zip(PREDS, REFS)] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert string_match_part("Paris, France", ["paris", "Lyon"]) == 1.0
    assert ruler_string_match_part(PREDS, REFS) == _ruler_part(PREDS, REFS) == 66.67


def test_passkey_exact_match():
    """The continuation must begin with the key, nothing but whitespace before, no digit after."""
    assert passkey_match(" 31337.", ["31337"]) == 1.0
    assert passkey_match("31337", ["31337"]) == 1.0
    assert passkey_match("\n31337 is the pass key", ["31337"]) == 1.0
    assert passkey_match(" 313370", ["31337"]) == 0.0
    assert passkey_match(" 3133", ["31337"]) == 0.0
    assert passkey_match(" is 31337", ["31337"]) == 0.0
    assert passkey_match("", ["31337"]) == 0.0
    with pytest.raises(ValueError, match="exactly one reference"):
        passkey_match("1", ["1", "2"])


def test_postprocess_and_task_scorers():
    """RULER's post-processing (strip, control characters -> newline) runs before every metric."""
    assert postprocess_prediction("  a\x00b\tc \n") == "a\nb\nc"
    assert score_prediction("niah_single_1", " The number is 1234567.", ["1234567"]) == 1.0
    assert score_prediction("cwe", "1. Apple 2. pear", ["apple", "pear", "fig", "kiwi"]) == 0.5
    assert score_prediction("passkey", "\t 12345", ["12345"]) == 1.0
    assert get_task("vt").score("ABCDE FGHIJ", ["abcde", "fghij"]) == 1.0


def test_aggregate_score():
    assert aggregate_score([1.0, 0.0, 0.5]) == 50.0
    assert aggregate_score([1 / 3]) == 33.33
    with pytest.raises(ValueError, match="no samples"):
        aggregate_score([])
    with pytest.raises(ValueError, match="3 predictions for 2"):
        ruler_string_match_all(["a", "b", "c"], [["a"], ["b"]])
    with pytest.raises(ValueError, match="at least one reference"):
        string_match_all("a", [])


def test_effective_length_definition_and_edges():
    """Longest L such that every evaluated length <= L reaches the threshold (>=, per RULER's table)."""
    scores = {4096: 95.0, 8192: 90.1, 16384: 85.6, 32768: 80.0, 65536: 86.0}
    result = effective_length(scores)
    assert result.length == 16384  # 64K passes again, but 32K failed before it
    assert result.passing == (4096, 8192, 16384, 65536) and not result.all_pass
    assert result.label == "16K" and result.threshold == DEFAULT_THRESHOLD == 85.6
    everything = effective_length({131072: 90.0, 4096: 99.0})  # order of the mapping does not matter
    assert everything.all_pass and everything.length == 131072 and everything.label == ">128K"
    nothing = effective_length({4096: 85.59, 8192: 99.0})
    assert nothing.length is None and nothing.label == "<4K" and nothing.passing == (8192,)
    assert effective_length({2048: 100.0}, threshold=100).label == ">2K"
    assert effective_length({2048: 99.99}, threshold=100).length is None
    assert effective_length({4096: 50.0, 8192: 40.0}, threshold=45).length == 4096


@pytest.mark.parametrize("bad", [0, -1, 100.01, 1000, math.nan, math.inf])
def test_threshold_outside_range_refused(bad):
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 100\]") as err:
        effective_length({4096: 90.0}, threshold=bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="threshold"):
        check_threshold(bad)


def test_effective_length_bad_input():
    assert check_threshold(100) == 100.0 and check_threshold("85.6") == 85.6
    with pytest.raises(ValueError, match="no scores"):
        effective_length({})
    with pytest.raises(ValueError, match=r"in \[0, 100\]"):
        effective_length({4096: 101.0})
    with pytest.raises(ValueError, match="positive integers"):
        effective_length({0: 90.0})


def test_average_over_tasks_and_labels():
    table = {"vt": {4096: 100.0, 8192: 80.0}, "cwe": {4096: 80.0, 8192: 60.0}}
    assert average_over_tasks(table) == {4096: 90.0, 8192: 70.0}
    with pytest.raises(ValueError, match="scored at lengths"):
        average_over_tasks({"vt": {4096: 1.0}, "cwe": {8192: 1.0}})
    assert [format_length(n) for n in (4096, 131072, 1 << 20, 3000)] == ["4K", "128K", "1M", "3000"]


def test_registry_table():
    """Tokens to generate and metrics per task, as RULER's constants.py sets them."""
    expected = {
        "niah_single_1": 128,
        "niah_multikey_2": 128,
        "niah_multikey_3": 128,
        "vt": 30,
        "cwe": 120,
        "fwe": 50,
    }
    assert {name: TASKS[name].tokens_to_generate for name in RULER_TASKS} == expected
    assert all(TASKS[name].metric == "string_match_all" for name in RULER_TASKS)
    assert TASKS["passkey"].metric == "passkey_match" and NIAH_TASKS == ("passkey", "niah_single_1")
    assert TASKS["niah_single_1"].answer_prefix == (
        " The special magic {type_needle_v} for {query} mentioned in the provided text is"
    )
    assert TASKS["niah_multivalue"].answer_prefix.endswith("provided text are")
    assert TASKS["cwe"].answer_prefix == " Answer: The top 10 words that appear most often in the list are:"
    assert {TASKS[n].metric for n in ("qa_1", "qa_2")} == {"string_match_part"} and TASKS[
        "qa_1"
    ].tokens_to_generate == 32
    assert {n for n, s in TASKS.items() if s.needs_data == "PaulGrahamEssays.json"} == {
        "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"
    }  # fmt: skip


def test_registry_errors_are_one_line_and_list_valid_names():
    for bad in ([], "", " , ", ()):
        with pytest.raises(ValueError, match="no tasks given; valid tasks: passkey, niah_single_1") as err:
            resolve_tasks(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown task 'niah'; valid tasks: .*fwe") as err:
        resolve_tasks(["vt", "niah"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("VT")
    specs = resolve_tasks("vt, cwe,vt", check_available=False)
    assert [s.name for s in specs] == ["vt", "cwe"]


def test_sentence_splitter():
    """Boundaries after . ! ? (with closing quotes) before a capital/digit/quote; not after
    abbreviations or initials, not without a space; joining the sentences restores the text."""
    text = (
        'It was late. "Are you sure?" she asked. Yes! 42 is the answer. Mr. Smith met Dr. J. Watson '
        "in the U.S. Today, e.g. This stays. no split before lowercase. It ended (finally.) And then "
        "mistakes.If glued. Last one"
    )
    sentences = split_sentences("  " + text + " ")
    assert sentences == [
        "It was late.",
        '"Are you sure?" she asked.',
        "Yes!",
        "42 is the answer.",
        "Mr. Smith met Dr. J. Watson in the U.S. Today, e.g. This stays. no split before lowercase.",
        "It ended (finally.)",
        "And then mistakes.If glued.",
        "Last one",
    ]
    assert " ".join(sentences) == text
    assert split_sentences("") == [] and split_sentences("   ") == []
    assert split_sentences("One sentence without an end") == ["One sentence without an end"]
