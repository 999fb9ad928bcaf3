"""Line-retrieval ("LongChat lines") records: prompt text and names, test cases, scoring."""

from ringft.lines.cases import (
    LineCase,
    derive_seed,
    load_cases_jsonl,
    make_line_case,
    make_line_cases,
    save_cases_jsonl,
    target_index_for_depth,
)
from ringft.lines.scoring import extract_first_integer, score_answer
from ringft.lines.text import (
    ADJECTIVES,
    LINE_RE,
    LINE_TEMPLATE,
    MAX_NUMBER,
    MIN_NUMBER,
    NOUNS,
    PREAMBLE,
    QUESTION_TEMPLATE,
    apply_template,
    build_record_text,
    encode_prompt,
    name_capacity,
    render_line,
    unique_names,
)

__all__ = [
    "ADJECTIVES",
    "LINE_RE",
    "LINE_TEMPLATE",
    "MAX_NUMBER",
    "MIN_NUMBER",
    "NOUNS",
    "PREAMBLE",
    "QUESTION_TEMPLATE",
    "LineCase",
    "apply_template",
    "build_record_text",
    "derive_seed",
    "encode_prompt",
    "extract_first_integer",
    "load_cases_jsonl",
    "make_line_case",
    "make_line_cases",
    "name_capacity",
    "render_line",
    "save_cases_jsonl",
    "score_answer",
    "target_index_for_depth",
    "unique_names",
]
