"""Line-retrieval prompt text and line names (pure Python, no tokenizer needed).

A record is a header, ``num_lines`` lines of the form::

    line brave-otter: REGISTER_CONTENT is <31337>

and a question asking for the number stored in one line. The header and question come from a
:class:`PromptStyle`: LongChat's own wording ("longchat") or this project's paraphrase ("ringft").
Names are hyphen-joined words, unique within a record and digit-free; everything is deterministic
from integer seeds (``random.Random(seed)`` instances only, never the global random state).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREAMBLE = (
    "Here is a record of lines that you need to remember. Every line starts with "
    "'line <line index>' and ends with a '<REGISTER_CONTENT>', which is a number. "
    "Memorize the <REGISTER_CONTENT> that belongs to each line index. When the record "
    "is finished, I will ask you for the <REGISTER_CONTENT> of one particular line "
    "index. The record begins now:\n\n"
)
LINE_TEMPLATE = "line {name}: REGISTER_CONTENT is <{number}>\n"
_QUESTION_ASK = "What is the <REGISTER_CONTENT> of line {name}? Answer with the number."
QUESTION_TEMPLATE = "\nThe record is finished. " + _QUESTION_ASK

# LongChat's line-retrieval strings (lm-sys/LongChat, longeval), reproduced verbatim so that figures
# compare with its published tables. Its record lines are exactly LINE_TEMPLATE.
LONGCHAT_HEADER = (
    "Below is a record of lines I want you to remember. "
    "Each line begins with 'line <line index>' and contains "
    "a '<REGISTER_CONTENT>' at the end of the line as a numerical value. "
    "For each line index, memorize its corresponding <REGISTER_CONTENT>. At "
    "the end of the record, I will ask you to retrieve the corresponding "
    "<REGISTER_CONTENT> of a certain line index. Now the record start:\n\n"
)
LONGCHAT_QUESTION = (
    "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {name}? I need the number."
)


@dataclass(frozen=True)
class PromptStyle:
    """The fixed text around a record's lines: ``header + lines + question.format(name=asked)``."""

    name: str
    header: str
    question: str


#: ``--prompt-style`` choices. "longchat" is LongChat's wording; "ringft" is this project's own
#: paraphrase, the one ringft's synthetic training records use.
PROMPT_STYLES: dict[str, PromptStyle] = {
    "longchat": PromptStyle("longchat", LONGCHAT_HEADER, LONGCHAT_QUESTION),
    "ringft": PromptStyle("ringft", PREAMBLE, QUESTION_TEMPLATE),
}


def get_prompt_style(name: str) -> PromptStyle:
    """The :class:`PromptStyle` called ``name``; ValueError naming the choices otherwise."""
    if name not in PROMPT_STYLES:
        raise ValueError(f"prompt style {name!r} is not one of {sorted(PROMPT_STYLES)}")
    return PROMPT_STYLES[name]


#: Matches one record line (without its trailing newline); groups: name, number.
LINE_RE = re.compile(r"^line ([a-z]+(?:-[a-z]+)+): REGISTER_CONTENT is <([0-9]+)>$")

MIN_NUMBER = 1
MAX_NUMBER = 50000

# ---------------------------------------------------------------------------------------
# Word lists. Names are hyphen-joined words; names in one record all have the same number
# of words and contain no digits (so echoing a name never confuses the scorer). Both
# lists are made "substring free" below: no word occurs inside another word of the same
# list, which guarantees that a name occurs in the record body exactly once (as a
# substring), not also inside a longer name such as "tired-x" containing "red-x".
# ---------------------------------------------------------------------------------------

_RAW_ADJECTIVES = """
able absurd agile amber ancient angry anxious arctic artful ashen awkward bashful
bitter blissful bold bouncy brave breezy bright brisk broad bumpy busy calm careful
cheeky chilly clever cloudy clumsy cosmic cozy crafty creamy crimson crisp curious
curly daring dusty eager early earnest elegant empty fancy fearless feisty fierce
fluffy foggy fragile frantic frosty fuzzy gentle giddy gloomy glossy golden graceful
grumpy hasty hollow honest humble hungry icy idle jolly jumpy keen kind lanky lazy
lively lonely loud lucky lumpy magic mellow merry mighty misty modest moody muddy
nimble noble noisy odd olive patient peaceful plucky polite proud purple quick quiet
rapid rosy rowdy royal rusty sandy scarlet shaggy shiny shy silent silky sleepy
slender slow smoky snowy sober soft solemn sparkly speedy spicy spotty steady sticky
stormy sturdy sunny swift tame tidy timid tiny tough tricky upbeat vast velvet vivid
wacky wary weary whimsical wild windy wise witty woolly zany zealous
"""

_RAW_NOUNS = """
acorn anchor apple arrow badger bagel banjo barrel basket beacon beetle biscuit
blanket bucket buffalo butter cabbage cactus camel candle canyon carrot castle cherry
chimney cobra comet compass cookie coyote crayon cricket dagger dolphin donkey dragon
eagle falcon feather ferret fiddle forest fossil fountain gadget garden gazelle glacier
goblin gopher guitar hammer harbor helmet hermit hippo hornet igloo island jacket
jaguar jigsaw kettle kitten koala ladder lantern lemon lizard llama lobster magnet
mango marble meadow mitten monkey muffin nectar needle noodle oyster paddle panther
parrot peach pebble pelican pepper pickle pigeon pillow planet pocket potato puffin
pumpkin puzzle quartz rabbit raccoon radish rocket saddle salmon sandal scooter
shovel spider spoon squid statue sunflower teapot thimble tiger tomato trumpet
tulip turnip turtle umbrella valley violin volcano waffle walrus wizard yacht zebra
"""


def _substring_free(words: Iterable[str]) -> tuple[str, ...]:
    """Sorted unique words, dropping any word that occurs inside another (longer) word."""
    uniq = sorted(set(words))
    return tuple(w for w in uniq if not any(w != o and w in o for o in uniq))


ADJECTIVES: tuple[str, ...] = _substring_free(_RAW_ADJECTIVES.split())
NOUNS: tuple[str, ...] = _substring_free(_RAW_NOUNS.split())


def name_capacity(num_words: int) -> int:
    """How many distinct names exist with ``num_words`` words ((num_words-1) adjectives + noun)."""
    if num_words < 2:
        raise ValueError("names have at least two words")
    return len(ADJECTIVES) ** (num_words - 1) * len(NOUNS)


def _words_for(count: int) -> int:
    """Smallest number of words per name whose capacity is at least ``2 * count``."""
    k = 2
    while name_capacity(k) < 2 * max(count, 1):
        k += 1
    return k


def _decode_name(code: int, num_words: int) -> str:
    """Mixed-radix decode of ``code`` into ``adj-...-adj-noun``."""
    code, noun = divmod(code, len(NOUNS))
    parts = [NOUNS[noun]]
    for _ in range(num_words - 1):
        code, adj = divmod(code, len(ADJECTIVES))
        parts.append(ADJECTIVES[adj])
    return "-".join(reversed(parts))


class RecordStream:
    """Lazily generated, deterministic sequence of (name, number) record lines.

    Line ``i`` depends only on the seed and ``num_words``, never on how many lines are
    eventually used, so ``lines[:n]`` is a prefix of ``lines[:m]`` for ``n < m``. Names are unique,
    and with ``distinct_nouns`` (the default) the first ``len(NOUNS)`` lines have distinct nouns
    (last words): a record of up to 130 lines is told apart by one word per line, as LongChat's
    large word lists make likely (with 130 nouns drawn freely, ~40% of the lines of a 70-line record
    would share their noun with another). ``distinct_nouns=False`` is the draw before that rule,
    kept for the demo tokenizer's training corpus.
    """

    def __init__(self, seed: int, num_words: int, distinct_nouns: bool = True) -> None:
        self._rng = random.Random(seed)
        self.num_words = num_words
        self.distinct_nouns = distinct_nouns
        self._capacity = name_capacity(num_words)
        self._used: set[int] = set()
        self._nouns: set[int] = set()
        self.names: list[str] = []
        self.numbers: list[int] = []

    def ensure(self, count: int) -> None:
        """Make sure at least ``count`` lines exist."""
        if count > self._capacity:
            raise ValueError(f"cannot make {count} unique {self.num_words}-word names")
        rng = self._rng
        while len(self.names) < count:
            # a new noun (the last word) while unused nouns remain, so that lines are told apart by
            # their last word as long as possible; then any unused name
            fresh_noun = self.distinct_nouns and len(self._nouns) < len(NOUNS)
            code = rng.randrange(self._capacity)
            while code in self._used or (fresh_noun and code % len(NOUNS) in self._nouns):
                code = rng.randrange(self._capacity)  # rejection sampling; capacity >> count keeps it fast
            self._used.add(code)
            self._nouns.add(code % len(NOUNS))
            self.names.append(_decode_name(code, self.num_words))
            self.numbers.append(rng.randint(MIN_NUMBER, MAX_NUMBER))

    def __len__(self) -> int:
        return len(self.names)


_RecordStream = (
    RecordStream  # the former private name, until ringft.data.line_retrieval.training imports RecordStream
)


def unique_names(
    count: int, seed: int, num_words: int | None = None, distinct_nouns: bool = True
) -> list[str]:
    """``count`` distinct, digit-free names in a deterministic random order (see :class:`RecordStream`).

    ``num_words`` defaults to the smallest word count that keeps the name space at least
    twice as large as ``count`` (2 words up to ~7K names, 3 words up to ~1M, ...).
    """
    stream = RecordStream(seed, num_words or _words_for(count), distinct_nouns)
    stream.ensure(count)
    return list(stream.names)


def render_line(name: str, number: int) -> str:
    """One record line, including its trailing newline."""
    return LINE_TEMPLATE.format(name=name, number=number)


def build_record_text(
    names: Sequence[str], numbers: Sequence[int], target_index: int, prompt_style: str = "ringft"
) -> str:
    """Raw (untemplated) prompt text: the style's header, one line per (name, number) pair (both
    sequences of length ``num_lines``), and the style's question about line ``target_index``."""
    chosen = get_prompt_style(prompt_style)
    body = "".join(render_line(n, v) for n, v in zip(names, numbers, strict=True))
    return chosen.header + body + chosen.question.format(name=names[target_index])
