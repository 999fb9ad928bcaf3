"""The typed value checks: one error style for recipe keys, command-line flags and trainer keywords."""

from __future__ import annotations

from functools import partial

import pytest

from ringft.utils import values


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
