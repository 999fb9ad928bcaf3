"""One rule, one place: the zigzag length rule, and failing together (its single-process
behaviour; the distributed one is in tests/model/test_document_offsets.py)."""

from __future__ import annotations

from functools import partial

import pytest

from ringft.ops.sharding import local_length_problem, zigzag_length_problem, zigzag_padded_length
from ringft.ops.validate import PeerFailed, fail_together, run_together
from ringft.utils import values


class Custom(values.BadValue):
    exit_code = 2


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
