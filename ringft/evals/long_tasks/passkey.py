"""Passkey retrieval in LongLoRA's format (``passkey_retrivial.py``, after Landmark Attention).

The prompt is five lines joined by ``"\\n"``: the task description, a prefix of the noise text, the
key line ``"The pass key is N. Remember it. N is the pass key."``, another prefix of the noise text
and the question ``"What is the pass key? The pass key is"``. The noise text is the noise sentence
repeated with single spaces; both noise pieces are cut from its start at a character count (so
they may end mid-word), the prefix holding ``int(depth * n)`` of the ``n`` noise characters and the
suffix the rest. The size parameter is ``n``. Strings are LongLoRA's, verbatim.

Deviations from LongLoRA, both deliberate:

- the key is a uniform 5-digit number in 10000..49999 (LongLoRA draws 1..49999, so 10% of its keys
  are shorter); a fixed width keeps the answer's token count the same in every cell of a heatmap;
- the question's last words, ``" The pass key is"``, are the answer prefix: for a raw prompt the
  text is LongLoRA's exactly, with a chat template they follow the generation prompt (RULER's
  convention; LongLoRA evaluated base models without one).

Scoring (:func:`ringft.evals.long_tasks.scoring.passkey_match`) is LongLoRA's exact match: the
continuation must start with the key and no further digit. ``Rendered.target`` is ``" N"``.
"""

from __future__ import annotations

import random

from ringft.evals.long_tasks.haystack import NOISE
from ringft.evals.long_tasks.prompt import Rendered
from ringft.evals.long_tasks.sample import TaskRequest

__all__ = [
    "PASSKEY_DESCRIPTION",
    "PASSKEY_LINE",
    "PASSKEY_PREFIX",
    "PASSKEY_QUESTION",
    "build_passkey",
    "noise_characters",
]

PASSKEY_DESCRIPTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_PREFIX = " The pass key is"
KEY_RANGE = (10000, 49999)


def noise_characters(count: int) -> str:
    """The first ``count`` characters of the noise sentence repeated with single spaces."""
    repeats = count // (len(NOISE) + 1) + 1
    return " ".join([NOISE] * repeats)[:count]


def build_passkey(request: TaskRequest):
    """Builder for ``passkey``: renders the prompt for ``n`` noise characters (smallest size 0)."""
    rng = random.Random(request.sample_seed)
    key = rng.randint(*KEY_RANGE)
    # LongLoRA draws the prefix length uniformly in [0, n) (numpy's randint); as a fraction of n here,
    # so the key's relative position does not move while the size is being fitted.
    fraction = request.depth if request.depth is not None else rng.random()

    def render(n: int) -> Rendered:
        prefix = min(n, int(fraction * n))
        lines = [
            PASSKEY_DESCRIPTION,
            noise_characters(prefix),
            PASSKEY_LINE.format(key=key),
            noise_characters(n - prefix),
            PASSKEY_QUESTION,
        ]
        depth = prefix / n if n else 0.0
        return Rendered("\n".join(lines), PASSKEY_PREFIX, (str(key),), (depth,), f" {key}")

    return render, 0
