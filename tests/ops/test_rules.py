"""One rule, one place: typed value checks (one error style), the zigzag length rule, and failing
together (its single-process behaviour; the distributed one is in tests/model/test_document_offsets.py)."""

from __future__ import annotations

from functools import partial

import pytest

from ringft.ops import values
from ringft.ops.sharding import local_length_problem, zigzag_length_problem, zigzag_padded_length
from ringft.ops.validate import PeerFailed, fail_together, run_together


class Custom(values.BadValue):
    exit_code = 2


def _message(check, *args, **kwargs) -> str:
    with pytest.raises(values.BadValue) as info:
        check(*args, **kwargs)
    return str(info.value)


def test_one_error_style_for_keys_and_flags():
    assert _message(values.as_integer, "train.max_steps", "20", 1) == (
        "train.max_steps must be an integer >= 1, got '20' (a string: write 20 without quotes)"
    )
    assert _message(values.as_number, "train.lr", 0, gt=0) == "train.lr must be a number > 0, got 0"
    assert "not a finite number" in _message(values.as_number, "x", float("nan"))
    assert values.as_number("train.lr", "2e-5", gt=0) == 2e-5  # YAML 1.1's string form
    assert _message(values.as_choice, "s", "linear", ("constant", "cosine")) == (
        "s must be one of constant, cosine, got 'linear'"
    )
    assert _message(values.as_integer, "--cases", 0, 1, fix="give at least 1 case") == (
        "--cases 0: give at least 1 case"
    )
    assert _message(values.as_number, "--gpu-mem", float("nan"), gt=0) == "--gpu-mem nan: not a finite number"
    assert _message(values.as_integer, "--gpus", 0, 1) == "--gpus 0: must be an integer >= 1"
    assert values.bad_value("--lengths", "", "", "give one") == "--lengths '': give one"
    with pytest.raises(Custom, match="t must be true or false"):
        values.as_bool("t", 1, error=Custom)
    assert values.as_integer("n", None, 1, optional=True) is None
    assert values.as_pair("b", [0.9, 0.95], 0, 1) == (0.9, 0.95)
    found = values.problems(partial(values.as_integer, "a", 0, 1), partial(values.as_text, "b", "ok"))
    assert found == ["a must be an integer >= 1, got 0"]


def test_zigzag_length_rule():
    assert zigzag_length_problem(48, 3) is None and zigzag_padded_length(46, 3) == 48
    assert zigzag_padded_length(0, 2) == 4 and zigzag_padded_length(23, 3, multiple_of=4) == 24
    message = zigzag_length_problem(50, 3, subject="data.seq_len=50")
    assert message.startswith("data.seq_len=50 is not divisible by 2 * cp_size = 6") and "e.g. 54" in message
    assert "must be even" in local_length_problem(7, 2) and local_length_problem(8, 3) is None


def test_fail_together_in_one_process():
    assert run_together(lambda: 7) == 7 and run_together(lambda: 7, here=False) is None
    fail_together(None)
    with pytest.raises(Custom, match="bad"):
        run_together(partial(values.as_integer, "x", "bad", error=Custom))
    assert PeerFailed(1, 2).exit_code == 2 and "rank 1" in str(PeerFailed(1, 2))
