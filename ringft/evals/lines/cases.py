"""Line-retrieval test cases: records fitted to a token budget (:mod:`ringft.data.line_retrieval.record`),
with the asked line at a requested depth, one :class:`LineCase` per (length, depth, case index), and
the key a finished case is stored under (:func:`case_key`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ringft.data.line_retrieval.record import fit_record
from ringft.data.seeds import derive_seed
from ringft.data.tokenizer import encode_prompt, has_chat_template

__all__ = [
    "LineCase",
    "case_key",
    "make_line_case",
    "make_line_cases",
]


@dataclass
class LineCase:
    """One line-retrieval test case (``prompt`` is the final text fed to the model).

    ``length`` is the requested prompt length in tokens and ``num_tokens`` the prompt's own count
    (for a case read from a LongChat file, ``length == num_tokens``); ``depth`` is the requested
    relative depth of the asked line and ``actual_depth = target_index / (num_lines - 1)``.
    ``prompt_style`` names the header/question wording, ``source`` where the case came from
    ("ringft": generated here; "longchat": a row of a LongChat test-case file, ``case_index`` =
    its line number in that file).
    """

    prompt: str
    answer: str
    target_line: str
    num_lines: int
    depth: float
    actual_depth: float
    length: int
    num_tokens: int
    seed: int
    case_index: int = 0
    target_index: int = 0
    chat_template: bool = False
    prompt_style: str = "ringft"
    source: str = "ringft"

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serializable)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """One-line JSON string."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> LineCase:
        """Inverse of :meth:`to_json` (also accepts a dict); unknown keys are ignored."""
        if isinstance(data, str):
            data = json.loads(data)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def input_ids(self, tokenizer: Any) -> list[int]:
        """Token ids ``(num_tokens,)`` of :attr:`prompt`, with the convention of ``num_tokens``."""
        return encode_prompt(tokenizer, self.prompt, self.chat_template)


def make_line_case(
    tokenizer: Any,
    target_tokens: int,
    depth: float,
    seed: int,
    case_index: int = 0,
    chat_template: bool | None = None,
    prompt_style: str = "ringft",
) -> LineCase:
    """Build one case whose prompt has as many lines as fit in ``target_tokens`` tokens.

    The returned prompt has ``num_tokens <= target_tokens`` and one more line would exceed
    the target. ``chat_template=None`` applies the tokenizer's chat template if it has one.
    """
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    record = fit_record(tokenizer, target_tokens, depth, seed, use_template, prompt_style)
    n, idx = len(record.names), record.target_index
    return LineCase(
        prompt=record.prompt,
        answer=record.answer,
        target_line=record.names[idx],
        num_lines=n,
        depth=float(depth),
        actual_depth=idx / (n - 1) if n > 1 else 0.0,
        length=int(target_tokens),
        num_tokens=record.num_tokens,
        seed=int(seed),
        case_index=int(case_index),
        target_index=idx,
        chat_template=use_template,
        prompt_style=prompt_style,
    )


def make_line_cases(
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float],
    cases_per_cell: int,
    seed: int,
    chat_template: bool | None = None,
    progress: bool = False,
    prompt_style: str = "ringft",
) -> list[LineCase]:
    """Cases for every (length, depth, case_index), in that nesting order.

    Each case's seed is ``derive_seed("lines-eval", seed, length, float(depth), case_index)``.
    """
    cells = [(L, float(d), i) for L in lengths for d in depths for i in range(cases_per_cell)]
    iterator: Iterable[tuple[int, float, int]] = cells
    if progress:
        from tqdm import tqdm

        iterator = tqdm(cells, desc="line cases")
    cases = []
    for length, depth, i in iterator:
        case_seed = derive_seed("lines-eval", seed, int(length), depth, i)
        case = make_line_case(tokenizer, int(length), depth, case_seed, i, chat_template, prompt_style)
        cases.append(case)
    return cases


def case_key(case: LineCase) -> str:
    """A finished case's key: its cell, index and seed (readable) and a hash of its final prompt."""
    digest = hashlib.sha256(case.prompt.encode()).hexdigest()[:16]
    return f"{case.source}|{case.length}|{case.depth}|{case.case_index}|{case.seed}|{digest}"
