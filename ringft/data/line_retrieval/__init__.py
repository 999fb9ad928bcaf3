"""Line-retrieval ("LongChat lines") records: prompt text and names (``text``), a record fitted to a
token budget (``record``) and synthetic training examples (``training``, which pulls in ``datasets``).
The evaluation built on these records (its cases, case files and scoring) is :mod:`ringft.evals.lines`."""

from ringft.data.line_retrieval.record import (
    FittedRecord,
    RecordTooShortError,
    fit_record,
    target_index_for_depth,
)
from ringft.data.line_retrieval.text import (
    ADJECTIVES,
    LINE_RE,
    LINE_TEMPLATE,
    LONGCHAT_HEADER,
    LONGCHAT_QUESTION,
    MAX_NUMBER,
    MIN_NUMBER,
    NOUNS,
    PREAMBLE,
    PROMPT_STYLES,
    QUESTION_TEMPLATE,
    PromptStyle,
    RecordStream,
    build_record_text,
    get_prompt_style,
    name_capacity,
    render_line,
    unique_names,
)

__all__ = [
    "ADJECTIVES",
    "LINE_RE",
    "LINE_TEMPLATE",
    "LONGCHAT_HEADER",
    "LONGCHAT_QUESTION",
    "MAX_NUMBER",
    "MIN_NUMBER",
    "NOUNS",
    "PREAMBLE",
    "PROMPT_STYLES",
    "QUESTION_TEMPLATE",
    "FittedRecord",
    "PromptStyle",
    "RecordStream",
    "RecordTooShortError",
    "build_record_text",
    "fit_record",
    "get_prompt_style",
    "name_capacity",
    "render_line",
    "target_index_for_depth",
    "unique_names",
]
