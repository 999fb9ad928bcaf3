"""The sample every long-context task produces, and the request a task's builder receives."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringft.evals.long_tasks.prompt import Rendered

__all__ = ["Builder", "Sample", "TaskRequest"]


@dataclass(frozen=True)
class TaskRequest:
    """What a task builder gets: the run ``seed``, this sample's own ``sample_seed`` (all of its
    random draws come from it), its ``index`` (RULER's QA tasks take question ``index`` of the data
    set), the requested ``length`` and the prompt ``budget`` in tokens, the
    requested needle ``depth`` (None: the benchmark's own placement) and the tokenizer (only the
    variable-tracking task uses it, to fit its one-shot example as RULER does)."""

    task: str
    tokenizer: Any
    length: int
    index: int
    budget: int
    seed: int
    sample_seed: int
    depth: float | None
    chat_template: bool


#: A task builder: the request -> (render(size) -> Rendered, smallest size). ``render`` must be
#: deterministic and its token count (nearly) non-decreasing in the size.
Builder = Callable[[TaskRequest], tuple[Callable[[int], Rendered], int]]


@dataclass(frozen=True)
class Sample:
    """One evaluation case.

    Feed the model ``prompt`` (= ``input + answer_prefix``), tokenized as
    ``encode_prompt(tokenizer, prompt, chat_template)`` (``num_tokens`` ids), generate
    ``tokens_to_generate`` tokens greedily and score the continuation against ``outputs`` with the
    task's scorer. ``input`` already holds the chat template when ``chat_template`` is true; the
    answer prefix follows the template's generation prompt, as in RULER.

    ``length`` is the requested sequence length: ``num_tokens + tokens_to_generate <= length`` when
    the generated tokens are counted (RULER's convention, the default), else ``num_tokens <=
    length``. ``depth`` is the requested needle depth (None: the benchmark's own placement) and
    ``needle_depths`` where the needles actually are (0 = start of the haystack, 1 = end).
    ``haystack_size`` is the fitted size parameter (lines, words or characters, per task). ``target``
    is the exact continuation a correct model writes, where the benchmark defines one (passkey),
    for teacher-forced scoring.
    """

    task: str
    length: int
    index: int
    seed: int
    depth: float | None
    input: str
    answer_prefix: str
    outputs: tuple[str, ...]
    num_tokens: int
    tokens_to_generate: int
    chat_template: bool
    haystack_size: int
    needle_depths: tuple[float, ...] = ()
    target: str | None = None

    @property
    def prompt(self) -> str:
        """The full text fed to the model."""
        return self.input + self.answer_prefix

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serializable)."""
        out = dataclasses.asdict(self)
        out["outputs"], out["needle_depths"] = list(self.outputs), list(self.needle_depths)
        return out

    def to_json(self) -> str:
        """One-line JSON."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown Sample fields: {', '.join(unknown)}")
        values = dict(data)
        values["outputs"] = tuple(values["outputs"])
        values["needle_depths"] = tuple(values.get("needle_depths", ()))
        return cls(**values)
