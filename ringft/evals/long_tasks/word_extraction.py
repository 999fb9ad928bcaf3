"""RULER's aggregation tasks: common-words extraction ``cwe`` and frequent-words extraction ``fwe``
(``scripts/data/synthetic/common_words_extraction.py``, ``freq_words_extraction.py``).

``cwe``: a numbered list ``"1. word 2. word ..."`` of ``n`` distinct words, 10 of them ("common")
repeated ``freq_cw = 30`` times and the rest ``freq_ucw = 3`` times (6 and 1 when the requested
length is below 4096), shuffled; the references are the 10 common words. One solved example
(40 words, repeats 10 and 3; 20 words, 3 and 1 below 4096) comes first, written as RULER writes it:
its template, answer prefix, a space and the numbered answer. Words are wonderwords' nouns,
adjectives and verbs (:mod:`ringft.evals.long_tasks.words`). Size: ``n``.

``fwe``: ``n`` words of a coded vocabulary of ``budget // 50`` random 6-letter words, the word of rank
``k`` appearing ``int(n * k**-alpha / zeta(alpha))`` times (Zipf, ``alpha = 2``), shuffled; rank 1
is ``"..."`` (noise the prompt tells the model to ignore) and the references are ranks 2 to 4.
Size: ``n``.

Both shuffle with a fresh ``random.Random(run_seed)``, as RULER does (the permutation then depends
only on the list's length). Deviations: per-sample seeds; the example is written inside the user
turn without a second copy of the chat template (RULER repeats its whole model template around the
example); the list is fitted by bisection (RULER's ``fwe`` steps down by ``budget // 32`` words, so
it can stop up to 3% short of the budget); ``fwe`` needs ranks 4 and 5 to differ in count, which
fixes its smallest size; ``cwe`` beyond wonderwords' vocabulary uses compound words
(:func:`ringft.evals.long_tasks.words.sample_cwe_words`).
"""

from __future__ import annotations

import math
import random
import string

from ringft.data.seeds import derive_seed
from ringft.evals.long_tasks.prompt import Rendered
from ringft.evals.long_tasks.sample import TaskRequest
from ringft.evals.long_tasks.words import sample_cwe_words

__all__ = [
    "CWE_ANSWER_PREFIX",
    "CWE_TEMPLATE",
    "FWE_ANSWER_PREFIX",
    "FWE_TEMPLATE",
    "build_cwe",
    "build_fwe",
    "zeta",
    "zipf_counts",
]

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)

NUM_CW = 10
SHORT_LENGTH = 4096  # RULER uses smaller repeat counts below this max_seq_length
FWE_ALPHA = 2.0
FWE_WORD_LENGTH = 6


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _cwe_list(words: list[str], common_repeats: int, uncommon_repeats: int, seed: int) -> str:
    common, uncommon = words[:NUM_CW], words[NUM_CW:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(listed)
    return _numbered(listed)


def build_cwe(request: TaskRequest):
    """Builder for ``cwe``: size = distinct words in the list (at least 10)."""
    if request.depth is not None:
        raise ValueError(f"{request.task}: a needle depth applies to single-needle tasks, not cwe")
    short = request.length < SHORT_LENGTH
    example_shape, shape = ((20, 3, 1), (6, 1)) if short else ((40, 10, 3), (30, 3))
    rng = random.Random(request.sample_seed)
    example_words = sample_cwe_words(rng, request.seed, example_shape[0])
    example_list = _cwe_list(example_words, example_shape[1], example_shape[2], request.seed)
    example = (
        CWE_TEMPLATE.format(context=example_list)
        + CWE_ANSWER_PREFIX
        + " "
        + _numbered(example_words[:NUM_CW])
    )
    list_seed = derive_seed("cwe-list", request.sample_seed)

    def render(n: int) -> Rendered:
        words = sample_cwe_words(random.Random(list_seed), request.seed, n)
        body = example + "\n" + CWE_TEMPLATE.format(context=_cwe_list(words, *shape, request.seed))
        return Rendered(body, CWE_ANSWER_PREFIX, tuple(words[:NUM_CW]))

    return render, NUM_CW


# Bernoulli numbers B_2, B_4, ..., B_14 for the Euler-Maclaurin tail of zeta.
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6)


def zeta(s: float, terms: int = 10) -> float:
    """Riemann zeta for real ``s > 1`` (RULER uses ``scipy.special.zeta``): ``terms - 1`` summed terms
    plus the Euler-Maclaurin tail; relative error below 1e-15 for ``s >= 1.5``."""
    if not s > 1:
        raise ValueError(f"zeta needs s > 1, got {s}")
    n = terms
    total = math.fsum(k**-s for k in range(1, n))
    total += n ** (1 - s) / (s - 1) + 0.5 * n**-s
    rising, power = s, n ** (-s - 1)  # s (s+1) ... (s+2j-2) and n^(-s-2j+1)
    for j, b in enumerate(_BERNOULLI, start=1):
        total += b / math.factorial(2 * j) * rising * power
        rising *= (s + 2 * j - 1) * (s + 2 * j)
        power /= n * n
    return total


def zipf_counts(num_words: int, vocab_size: int, alpha: float = FWE_ALPHA) -> list[int]:
    """RULER's counts: ``int(num_words * k**-alpha / zeta(alpha))`` for ranks ``k = 1..vocab_size``."""
    z = zeta(alpha)
    return [int(num_words * (k**-alpha) / z) for k in range(1, vocab_size + 1)]


def fwe_minimum(vocab_size: int, alpha: float = FWE_ALPHA) -> int:
    """Fewest words for which rank 4 outnumbers rank 5 (the three answers are then unambiguous)."""
    n = 1
    while True:
        counts = zipf_counts(n, min(vocab_size, 5), alpha) + [0]
        if counts[3] > counts[4]:
            return n
        n += 1


def _coded_vocabulary(rng: random.Random, size: int, seed: int) -> list[str]:
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH)) for _ in range(size)]
    while len(set(vocab)) < size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    return vocab


def build_fwe(request: TaskRequest):
    """Builder for ``fwe``: size = words in the coded text."""
    if request.depth is not None:
        raise ValueError(f"{request.task}: a needle depth applies to single-needle tasks, not fwe")
    vocab_size = request.budget // 50
    if vocab_size < 4:
        raise ValueError(
            f"{request.task}: length {request.length} gives a coded vocabulary of {vocab_size} words "
            f"(prompt tokens // 50, as RULER); it needs at least 4, so a length of at least "
            f"{request.length - request.budget + 200}"
        )
    vocab = _coded_vocabulary(random.Random(request.sample_seed), vocab_size, request.seed)

    def render(n: int) -> Rendered:
        listed = [word for word, count in zip(vocab, zipf_counts(n, vocab_size)) for _ in range(count)]
        random.Random(request.seed).shuffle(listed)
        body = FWE_TEMPLATE.format(context=" ".join(listed))
        return Rendered(body, FWE_ANSWER_PREFIX, tuple(vocab[1:4]))

    return render, fwe_minimum(vocab_size)
