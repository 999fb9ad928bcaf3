"""Random keys, values and words, drawn as RULER draws them (``scripts/data/synthetic/niah.py``,
``common_words_extraction.py``).

Word lists come from the ``wonderwords`` package (MIT licence) at run time, exactly the files RULER
reads (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``); install it with
``pip install wonderwords`` (or ``ringft[eval]``). Every draw takes an explicit ``random.Random``, so
a sample is a pure function of its seed.
"""

from __future__ import annotations

import random
import uuid
from functools import cache
from importlib import metadata, resources

__all__ = [
    "WordListsMissingError",
    "adjectives",
    "cwe_words",
    "nouns",
    "random_needle_value",
    "random_number",
    "random_uuid",
    "random_word",
    "verbs",
    "wonderwords_version",
]

NEEDLE_TYPES = ("numbers", "words", "uuids")


class WordListsMissingError(ImportError):
    """The ``wonderwords`` package (RULER's word lists) is not installed."""

    def __init__(self) -> None:
        super().__init__(
            "RULER's word lists come from the wonderwords package: pip install wonderwords "
            "(or pip install 'ringft[eval]')"
        )


@cache
def _word_file(name: str) -> tuple[str, ...]:
    """One of wonderwords' word files, one word a line, right-stripped (as RULER reads them)."""
    try:
        root = resources.files("wonderwords.assets")
    except ModuleNotFoundError as err:
        raise WordListsMissingError() from err
    return tuple(line.rstrip() for line in root.joinpath(name).read_text(encoding="utf-8").splitlines())


def wonderwords_version() -> str:
    """Installed ``wonderwords`` version (its word lists change between releases)."""
    try:
        return metadata.version("wonderwords")
    except metadata.PackageNotFoundError as err:
        raise WordListsMissingError() from err


def nouns() -> tuple[str, ...]:
    """wonderwords' noun list, in file order."""
    return _word_file("nounlist.txt")


def adjectives() -> tuple[str, ...]:
    """wonderwords' adjective list, in file order."""
    return _word_file("adjectivelist.txt")


def verbs() -> tuple[str, ...]:
    """wonderwords' verb list, in file order."""
    return _word_file("verblist.txt")


@cache
def _pair_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(sorted(set(adjectives()))), tuple(sorted(set(nouns())))


def random_word(rng: random.Random) -> str:
    """A random ``adjective-noun`` key, uniform over RULER's ``sorted(set(f"{adj}-{noun}"))``.

    RULER materialises that list (about 6.2 million strings) and calls ``random.choice`` on it; the
    distinct adjectives times the distinct nouns give exactly that many distinct strings (checked by
    the tests), so drawing the adjective and the noun independently is the same distribution
    without building the list. The individual draws differ from RULER's (a different RNG stream).
    """
    adjs, nns = _pair_lists()
    return f"{adjs[rng.randrange(len(adjs))]}-{nns[rng.randrange(len(nns))]}"


def random_number(rng: random.Random, num_digits: int = 7) -> str:
    """A uniform ``num_digits``-digit number (RULER: 7 digits, ``randint(10**6, 10**7 - 1)``)."""
    return str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A random version-4 UUID string, built as RULER builds it from 128 random bits."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_needle_value(kind: str, rng: random.Random) -> str:
    """A needle key or value of RULER type ``kind``: "numbers", "words" or "uuids"."""
    if kind == "numbers":
        return random_number(rng)
    if kind == "words":
        return random_word(rng)
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"needle type must be one of {', '.join(NEEDLE_TYPES)}, got {kind!r}")


@cache
def cwe_words(run_seed: int) -> tuple[str, ...]:
    """RULER's common-words vocabulary: ``sorted(set(nouns + adjectives + verbs))`` shuffled with
    ``random.Random(run_seed)`` (RULER shuffles it once with its run seed)."""
    words = sorted(set(nouns() + adjectives() + verbs()))
    random.Random(run_seed).shuffle(words)
    return tuple(words)


@cache
def cwe_extension() -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """Adjectives, nouns and the single words, for compound ``adjective-noun`` extra words."""
    adjs, nns = _pair_lists()
    return adjs, nns, frozenset(nouns() + adjectives() + verbs())


def sample_cwe_words(rng: random.Random, run_seed: int, num_words: int) -> list[str]:
    """``num_words`` distinct words for the common-words task, the first ones uniform.

    Up to the size of :func:`cwe_words` this is RULER's ``random.sample(words, num_words)``. Beyond
    it RULER switches to its ``english_words.json`` list (stored with Git LFS in its repository and
    shipped by no package), so here every single word is used (in random order, the common words
    among them) and the rest are distinct random ``adjective-noun`` compounds that are not single
    words themselves (a documented deviation that only applies to very long prompts: about 8,000
    words times 3 repeats, 150K tokens or more).
    """
    words = cwe_words(run_seed)
    if num_words <= len(words):
        return rng.sample(words, num_words)
    chosen = rng.sample(words, len(words))
    adjs, nns, singles = cwe_extension()
    if num_words - len(words) > len(adjs) * len(nns) // 2:
        raise ValueError(f"the common-words task cannot draw {num_words} distinct words")
    seen = set(chosen)
    while len(chosen) < num_words:
        word = f"{adjs[rng.randrange(len(adjs))]}-{nns[rng.randrange(len(nns))]}"
        if word not in seen and word not in singles:
            seen.add(word)
            chosen.append(word)
    return chosen
