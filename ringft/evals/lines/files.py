"""Case files: ringft's own jsonl (one :class:`LineCase` per line) and LongChat's test-case jsonl.

LongChat's line-retrieval test cases (lm-sys/LongChat, ``longeval/evaluation/lines/testcases/
<N>_lines.jsonl``, 50 rows per file) have one JSON object per line with the fields

- ``prompt``: the whole raw prompt (header, ``num_lines`` record lines, question);
- ``random_idx``: ``[asked line key, its 0-based position among the record lines]``;
- ``expected_number``: the number stored in the asked line (int);
- ``num_lines``: the number of record lines;
- ``correct_line``: the asked record line, ``"line <key>: REGISTER_CONTENT is <N>\\n"``;
- optional ``token_size`` / ``prompt_length`` (LLaMA token counts; ignored here).

Its evaluator wraps ``prompt`` in one user turn of the model's chat template, exactly as ringft
does, so the rows are read verbatim and checked for consistency (the asked line must be the
``correct_line`` at ``random_idx[1]`` and hold ``expected_number``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ringft.data.line_retrieval.text import LONGCHAT_HEADER
from ringft.data.tokenizer import apply_template, encode_prompt, has_chat_template
from ringft.evals.lines.cases import LineCase

__all__ = ["CasesFileError", "load_cases_jsonl", "longchat_case", "save_cases_jsonl"]

_LONGCHAT_FIELDS = ("prompt", "random_idx", "expected_number", "num_lines", "correct_line")


class CasesFileError(ValueError):
    """A case file that cannot be read; the message names the file and the line number."""


def save_cases_jsonl(cases: Iterable[LineCase], path: str | Path) -> None:
    """Write one JSON object per line (UTF-8); parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for case in cases:
            f.write(case.to_json() + "\n")


def longchat_case(
    row: dict[str, Any], tokenizer: Any, chat_template: bool | None = None, case_index: int = 0
) -> LineCase:
    """A :class:`LineCase` from one row of a LongChat test-case file (fields in the module doc).

    The prompt is used verbatim, wrapped in the tokenizer's chat template when it has one (or as
    ``chat_template`` says); ``num_tokens`` is counted with ``tokenizer``. ValueError naming the
    field when the row is incomplete or inconsistent.
    """
    missing = [k for k in _LONGCHAT_FIELDS if k not in row]
    if missing:
        raise ValueError(f"LongChat row lacks field(s) {missing}")
    prompt, key_pos, number = row["prompt"], row["random_idx"], row["expected_number"]
    num_lines, correct_line = row["num_lines"], row["correct_line"]
    if not (isinstance(key_pos, list) and len(key_pos) == 2 and isinstance(key_pos[1], int)):
        raise ValueError(f"random_idx must be [key, line position], got {key_pos!r}")
    if not isinstance(number, int) or not isinstance(num_lines, int) or num_lines < 1:
        raise ValueError(f"expected_number and num_lines must be integers, got {number!r}, {num_lines!r}")
    if not prompt.startswith(LONGCHAT_HEADER):
        raise ValueError("prompt does not start with LongChat's header")
    key, position = str(key_pos[0]), key_pos[1]
    lines = prompt[len(LONGCHAT_HEADER) :].split("\n")[:num_lines]
    if not 0 <= position < num_lines or lines[position] + "\n" != correct_line:
        raise ValueError(f"record line {position} is not the correct_line {correct_line!r}")
    if correct_line != f"line {key}: REGISTER_CONTENT is <{number}>\n":
        raise ValueError(f"correct_line {correct_line!r} does not hold key {key!r} and <{number}>")
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    final = apply_template(tokenizer, prompt, use_template)
    num_tokens = len(encode_prompt(tokenizer, final, use_template))
    return LineCase(
        prompt=final,
        answer=str(number),
        target_line=key,
        num_lines=num_lines,
        depth=position / (num_lines - 1) if num_lines > 1 else 0.0,
        actual_depth=position / (num_lines - 1) if num_lines > 1 else 0.0,
        length=num_tokens,
        num_tokens=num_tokens,
        seed=0,
        case_index=case_index,
        target_index=position,
        chat_template=use_template,
        prompt_style="longchat",
        source="longchat",
    )


def load_cases_jsonl(
    path: str | Path, tokenizer: Any = None, chat_template: bool | None = None
) -> list[LineCase]:
    """Read a case file: rows written by :func:`save_cases_jsonl`, or LongChat test-case rows
    (told apart by their ``expected_number`` field; those need ``tokenizer``, see
    :func:`longchat_case`). Blank lines are skipped. :class:`CasesFileError` naming the file and
    the 1-based line number on the first bad row; FileNotFoundError when there is no file."""
    path = Path(path)
    cases: list[LineCase] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                if "expected_number" in row:
                    if tokenizer is None:
                        raise ValueError("a LongChat row needs a tokenizer to count its tokens")
                    cases.append(longchat_case(row, tokenizer, chat_template, case_index=number))
                else:
                    cases.append(LineCase.from_json(row))
            except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
                raise CasesFileError(f"{path} line {number}: {exc}") from None
    if not cases:
        raise CasesFileError(f"{path} holds no cases")
    return cases
