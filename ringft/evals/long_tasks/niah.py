"""RULER's needle-in-a-haystack tasks (``scripts/data/synthetic/niah.py``, ``synthetic.yaml``).

Needles are ``"One of the special magic {type_needle_v} for {key} is: {value}."`` (keys and values:
adjective-noun words, 7-digit numbers or UUIDs). The haystack is RULER's noise sentence repeated one
per line, Paul Graham's essays (:mod:`ringft.evals.long_tasks.haystack`), or a line of distractor
needles each (``needle``). The question asks for the values of ``num_needle_q`` of the keys; the
references are all of their values. With one query and one value the template is made singular
exactly as RULER does (``Some`` -> ``A``, ``are all``/``are`` -> ``is``, ``numbers`` -> ``number``).

Placement, as RULER: noise and needle haystacks put the needles on ``random.sample(range(n), k)``
lines; essays split into sentences and insert the needles at depths drawn from :data:`DEPTHS`.
With an explicit ``depth`` (single-needle tasks only, for heatmaps) the needle goes after
``int(depth * n)`` of the ``n`` lines or sentences.

Deviations from RULER: its draws come from one global RNG per run, here from each sample's own
seed (so any sample can be made alone, on any rank); distractor needles never reuse a queried key
(RULER does not check: at long lengths a distractor could, rarely, carry the asked key and make the
answer ambiguous); the essay is split by :func:`split_sentences`, not nltk's punkt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ringft.data.seeds import derive_seed
from ringft.evals.long_tasks.haystack import DEPTHS, NOISE, essay_words, join_essay_words, split_sentences
from ringft.evals.long_tasks.prompt import Rendered
from ringft.evals.long_tasks.sample import TaskRequest
from ringft.evals.long_tasks.words import random_needle_value

__all__ = ["NEEDLE", "NIAH_ANSWER_PREFIX", "NIAH_CONFIGS", "NIAH_TEMPLATE", "NiahConfig", "build_niah"]

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
    "{type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH task's arguments in RULER's ``synthetic.yaml``."""

    type_haystack: str  # "noise", "essay" or "needle"
    type_needle_k: str  # "words", "numbers" or "uuids"
    type_needle_v: str
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1

    @property
    def num_keys(self) -> int:
        """RULER: ``num_needle_k = max(num_needle_k, num_needle_q)``."""
        return max(self.num_needle_k, self.num_needle_q)

    @property
    def num_needles(self) -> int:
        """Needles inserted into the haystack (keys x values)."""
        return self.num_keys * self.num_needle_v


NIAH_CONFIGS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_needle_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_needle_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_needle_q=4),
}


def niah_template(config: NiahConfig) -> tuple[str, str, str]:
    """``(template, answer_prefix, type_needle_v)`` after RULER's singular rewrite (applied to the
    template and answer prefix together, as RULER applies it to its whole prompt template)."""
    template, prefix, type_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, config.type_needle_v
    if config.num_needle_q * config.num_needle_v == 1:
        joined = template + "\0" + prefix
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            joined = joined.replace(old, new)
        template, prefix = joined.split("\0")
        type_v = type_v[:-1]
    return template, prefix, type_v


def _insert_lines(lines: list[str], needles: list[str], indexes: list[int]) -> None:
    """RULER's insertion: descending indexes, each needle inserted at its index."""
    for index, needle in zip(sorted(indexes, reverse=True), needles):
        lines.insert(index, needle)


def build_niah(config: NiahConfig):
    """The builder for one NIAH configuration."""

    def build(request: TaskRequest):
        rng = random.Random(request.sample_seed)
        keys, values, needles = [], [], []
        for _ in range(config.num_keys):
            keys.append(random_needle_value(config.type_needle_k, rng))
            values.append([])
            for _ in range(config.num_needle_v):
                values[-1].append(random_needle_value(config.type_needle_v, rng))
                needles.append(
                    NEEDLE.format(type_needle_v=config.type_needle_v, key=keys[-1], value=values[-1][-1])
                )
        random.Random(request.seed).shuffle(needles)  # RULER shuffles with a fresh RNG of the run seed
        asked = rng.sample(range(config.num_keys), config.num_needle_q)
        queries = [keys[i] for i in asked]
        answers = tuple(a for i in asked for a in values[i])
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = niah_template(config)
        answer_prefix = prefix.format(type_needle_v=type_v, query=query)
        haystack_seed = derive_seed("niah-haystack", request.sample_seed)
        depth, k = request.depth, len(needles)
        if depth is not None and k != 1:
            raise ValueError(
                f"{request.task}: a needle depth applies to single-needle tasks, this one has {k}"
            )
        words = essay_words(request.task) if config.type_haystack == "essay" else ()
        taken = set(keys)

        def render(n: int) -> Rendered:
            hay_rng = random.Random(haystack_seed)
            if config.type_haystack == "essay":
                sentences = split_sentences(join_essay_words(words, n).strip())
                total = len(sentences)
                if depth is not None:
                    positions = [int(total * depth)]
                else:
                    positions = sorted(int(total * (d / 100)) for d in hay_rng.sample(DEPTHS, k))
                bounds = [0, *positions, total]
                pieces = []
                for i in range(1, len(bounds)):
                    pieces.append(" ".join(sentences[bounds[i - 1] : bounds[i]]))
                    if i - 1 < k:
                        pieces.append(needles[i - 1])
                context = " ".join(pieces)
            else:
                if config.type_haystack == "noise":
                    lines = [NOISE] * n
                else:
                    lines = []
                    for _ in range(n):
                        key = random_needle_value(config.type_needle_k, hay_rng)
                        while key in taken:
                            key = random_needle_value(config.type_needle_k, hay_rng)
                        value = random_needle_value(config.type_needle_v, hay_rng)
                        lines.append(NEEDLE.format(type_needle_v=config.type_needle_v, key=key, value=value))
                total = n
                positions = [int(n * depth)] if depth is not None else hay_rng.sample(range(n), k)
                _insert_lines(lines, needles, positions)
                context = "\n".join(lines)
            body = template.format(type_needle_v=type_v, context=context, query=query)
            depths = tuple(sorted(p / total if total else 0.0 for p in positions))
            return Rendered(body, answer_prefix, answers, depths)

        minimum = k if (config.type_haystack != "essay" and depth is None) else 0
        return render, minimum

    return build
