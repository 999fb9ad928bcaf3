"""Line-retrieval ("LongChat lines") test generation, scoring and synthetic training data.

A test prompt is a preamble, a record of ``num_lines`` lines of the form::

    line brave-otter: REGISTER_CONTENT is <31337>

and a question asking for the number stored in one line (the *target*). The target is
placed at a requested relative *depth* (0 = first line, 1 = last line). The number of
lines is chosen so that the tokenized prompt is as long as possible without exceeding a
requested token count.

Everything is deterministic from integer seeds: only ``random.Random(seed)`` instances
are used, never the global random state.

Token counting convention: the prompt's tokens are ``encode_prompt(tokenizer, prompt,
chat_template)``, i.e. ``tokenizer(prompt, add_special_tokens=True)`` for raw prompts (so
a BOS is counted when the tokenizer adds one) and ``add_special_tokens=False`` when a
chat template was applied (chat templates write their own BOS as text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ADJECTIVES",
    "LINE_RE",
    "LINE_TEMPLATE",
    "MAX_NUMBER",
    "MIN_NUMBER",
    "NOUNS",
    "PREAMBLE",
    "QUESTION_TEMPLATE",
    "LineCase",
    "apply_template",
    "build_record_text",
    "derive_seed",
    "encode_prompt",
    "extract_first_integer",
    "load_cases_jsonl",
    "make_line_case",
    "make_line_cases",
    "make_synthetic_dataset",
    "make_synthetic_example",
    "name_capacity",
    "render_line",
    "save_cases_jsonl",
    "score_answer",
    "target_index_for_depth",
    "unique_names",
]

# ---------------------------------------------------------------------------------------
# Text pieces
# ---------------------------------------------------------------------------------------

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


class _RecordStream:
    """Lazily generated, deterministic sequence of (name, number) record lines.

    Line ``i`` depends only on the seed and ``num_words``, never on how many lines are
    eventually used, so ``lines[:n]`` is a prefix of ``lines[:m]`` for ``n < m``.
    """

    def __init__(self, seed: int, num_words: int) -> None:
        self._rng = random.Random(seed)
        self.num_words = num_words
        self._capacity = name_capacity(num_words)
        self._used: set[int] = set()
        self.names: list[str] = []
        self.numbers: list[int] = []

    def ensure(self, count: int) -> None:
        """Make sure at least ``count`` lines exist."""
        if count > self._capacity:
            raise ValueError(f"cannot make {count} unique {self.num_words}-word names")
        rng = self._rng
        while len(self.names) < count:
            code = rng.randrange(self._capacity)
            while code in self._used:  # rejection sampling; capacity >> count keeps it fast
                code = rng.randrange(self._capacity)
            self._used.add(code)
            self.names.append(_decode_name(code, self.num_words))
            self.numbers.append(rng.randint(MIN_NUMBER, MAX_NUMBER))

    def __len__(self) -> int:
        return len(self.names)


def unique_names(count: int, seed: int, num_words: int | None = None) -> list[str]:
    """``count`` distinct, digit-free names in a deterministic random order.

    ``num_words`` defaults to the smallest word count that keeps the name space at least
    twice as large as ``count`` (2 words up to ~7K names, 3 words up to ~1M, ...).
    """
    stream = _RecordStream(seed, num_words or _words_for(count))
    stream.ensure(count)
    return list(stream.names)


def render_line(name: str, number: int) -> str:
    """One record line, including its trailing newline."""
    return LINE_TEMPLATE.format(name=name, number=number)


def build_record_text(names: Sequence[str], numbers: Sequence[int], target_index: int) -> str:
    """Raw (untemplated) prompt text: preamble, all lines, question about ``target_index``."""
    body = "".join(render_line(n, v) for n, v in zip(names, numbers, strict=True))
    return PREAMBLE + body + QUESTION_TEMPLATE.format(name=names[target_index])


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_template(tokenizer: Any, text: str, chat_template: bool) -> str:
    """Wrap ``text`` as a single user turn with the tokenizer's chat template if requested."""
    if not chat_template:
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool = False) -> list[int]:
    """Token ids of a final prompt (BOS added by the tokenizer only for raw prompts)."""
    enc = tokenizer(prompt, add_special_tokens=not chat_template, verbose=False)
    return list(enc["input_ids"])


def target_index_for_depth(depth: float, num_lines: int) -> int:
    """Line index for a relative depth: 0 -> first, 1 -> last, else round-half-up."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if num_lines < 1:
        raise ValueError("num_lines must be >= 1")
    return min(num_lines - 1, math.floor(depth * (num_lines - 1) + 0.5))


def derive_seed(*parts: object) -> int:
    """Stable 63-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    key = "|".join(f"{p:.6f}" if isinstance(p, float) else str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


@dataclass
class LineCase:
    """One line-retrieval test case (``prompt`` is the final text fed to the model)."""

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
        """Token ids of :attr:`prompt` with the same convention used for ``num_tokens``."""
        return encode_prompt(tokenizer, self.prompt, self.chat_template)


def _line_token_counts(tokenizer: Any, lines: Sequence[str]) -> list[int]:
    if not lines:
        return []
    enc = tokenizer(list(lines), add_special_tokens=False, verbose=False)
    return [len(ids) for ids in enc["input_ids"]]


_PROBE_LINES = 32


def _build_case(
    tokenizer: Any,
    target_tokens: int,
    depth: float,
    seed: int,
    chat_template: bool,
) -> tuple[_RecordStream, int, int, str, int]:
    """Search the line count; returns (stream, num_lines, target_index, prompt, num_tokens)."""
    if target_tokens < 1:
        raise ValueError("target_tokens must be positive")
    target_index_for_depth(depth, 1)  # validates depth

    def count(text: str) -> int:
        prompt = apply_template(tokenizer, text, chat_template)
        return len(encode_prompt(tokenizer, prompt, chat_template))

    # 1) Cheap probe: in-context tokens per line, fixed overhead, and the ratio between
    #    in-context and standalone line counts (1.0 for tokenizers that are additive on line
    #    boundaries). Also choose the name width so that names stay unique.
    probe_rng_seed = derive_seed("probe", seed)
    num_words = 2
    while True:
        probe = _RecordStream(probe_rng_seed, num_words)
        probe.ensure(_PROBE_LINES)
        pairs = zip(probe.names, probe.numbers, strict=True)
        per_line = _line_token_counts(tokenizer, [render_line(n, v) for n, v in pairs])
        one = count(build_record_text(probe.names[:1], probe.numbers[:1], 0))
        many = count(build_record_text(probe.names, probe.numbers, 0))
        tpl = max(1e-3, (many - one) / (_PROBE_LINES - 1))
        ratio0 = tpl * (_PROBE_LINES - 1) / max(1, sum(per_line[1:]))
        n_est = max(1, int((target_tokens - (one - tpl)) / tpl))
        if name_capacity(num_words) >= 2 * (int(n_est * 1.1) + 16):
            break
        num_words += 1

    stream = _RecordStream(seed, num_words)
    prefix = [0]  # prefix[i] = summed standalone token counts of the first i lines

    def extend(n_lines: int) -> None:
        have = len(stream)
        if n_lines <= have:
            return
        stream.ensure(n_lines)
        lines = [render_line(stream.names[i], stream.numbers[i]) for i in range(have, n_lines)]
        for c in _line_token_counts(tokenizer, lines):
            prefix.append(prefix[-1] + c)

    cache: dict[int, tuple[int, str]] = {}

    def measure(n: int) -> int:
        if n not in cache:
            extend(n + 1)
            idx = target_index_for_depth(depth, n)
            text = build_record_text(stream.names[:n], stream.numbers[:n], idx)
            prompt = apply_template(tokenizer, text, chat_template)
            cache[n] = (len(encode_prompt(tokenizer, prompt, chat_template)), prompt)
        return cache[n][0]

    def estimate(n: int, ratio: float) -> int:
        # Largest m with measure(n) + ratio * (prefix[m] - prefix[n]) <= target (m >= 1).
        base = measure(n) - ratio * prefix[n]
        while base + ratio * prefix[-1] <= target_tokens:
            extend(max(len(stream) + 64, int(len(stream) * 1.25)))
        lo, hi = 0, len(prefix) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if base + ratio * prefix[mid] <= target_tokens:
                lo = mid
            else:
                hi = mid - 1
        return max(1, lo)

    # 2) Safeguarded secant search on full tokenizations for the largest n with
    #    measure(n) <= target < measure(n + 1). Each step extrapolates from the last
    #    measurement with the standalone per-line counts scaled by the measured slope, and
    #    never leaves the current bracket (bisection every third bracketed step).
    extend(int(n_est * 1.1) + 16)
    n, prev, ratio, bracketed = n_est, None, ratio0, 0
    found = None
    for _ in range(64):
        c = measure(n)
        if prev is not None and prefix[n] != prefix[prev]:
            slope = (c - measure(prev)) / (prefix[n] - prefix[prev])
            ratio = min(max(slope, 0.1 * ratio0), 10.0 * ratio0)
        below = [m for m, (cm, _) in cache.items() if cm <= target_tokens]
        lo = max(below) if below else None
        above = [m for m, (cm, _) in cache.items() if cm > target_tokens and m > (lo or 0)]
        hi = min(above) if above else None
        if lo is None and hi == 1:
            msg = f"a single-line prompt already has {c} tokens"
            raise ValueError(f"target_tokens={target_tokens} is too small: {msg}")
        if lo is not None and hi == lo + 1:
            found = lo
            break
        guess = estimate(n, ratio)
        if lo is not None and hi is not None:
            bracketed += 1
            if not lo < guess < hi or bracketed % 3 == 0:
                guess = (lo + hi) // 2
        elif lo is not None:
            guess = max(guess, lo + 1)
        else:
            guess = max(1, min(guess, hi - 1))
        prev, n = n, guess
    if found is None:  # pragma: no cover - defensive linear finish
        found = max(1, n)
        while found > 1 and measure(found) > target_tokens:
            found -= 1
        while measure(found + 1) <= target_tokens:
            found += 1
        if measure(found) > target_tokens:
            raise ValueError(f"target_tokens={target_tokens} is too small")
    n = found
    num_tokens, prompt = cache[n]
    return stream, n, target_index_for_depth(depth, n), prompt, num_tokens


def make_line_case(
    tokenizer: Any,
    target_tokens: int,
    depth: float,
    seed: int,
    case_index: int = 0,
    chat_template: bool | None = None,
) -> LineCase:
    """Build one case whose prompt has as many lines as fit in ``target_tokens`` tokens.

    The returned prompt has ``num_tokens <= target_tokens`` and one more line would exceed
    the target. ``chat_template=None`` applies the tokenizer's chat template if it has one.
    Cost: a tokenization of every line (batched) plus a few full-prompt tokenizations.
    """
    use_template = _has_chat_template(tokenizer) if chat_template is None else chat_template
    built = _build_case(tokenizer, target_tokens, depth, seed, use_template)
    stream, n, idx, prompt, num_tokens = built
    return LineCase(
        prompt=prompt,
        answer=str(stream.numbers[idx]),
        target_line=stream.names[idx],
        num_lines=n,
        depth=float(depth),
        actual_depth=idx / (n - 1) if n > 1 else 0.0,
        length=int(target_tokens),
        num_tokens=num_tokens,
        seed=int(seed),
        case_index=int(case_index),
        target_index=idx,
        chat_template=use_template,
    )


def make_line_cases(
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float],
    cases_per_cell: int,
    seed: int,
    chat_template: bool | None = None,
    progress: bool = False,
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
        cases.append(make_line_case(tokenizer, int(length), depth, case_seed, i, chat_template))
    return cases


def save_cases_jsonl(cases: Iterable[LineCase], path: str | Path) -> None:
    """Write one JSON object per line (UTF-8); parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for case in cases:
            f.write(case.to_json() + "\n")


def load_cases_jsonl(path: str | Path) -> list[LineCase]:
    """Read cases written by :func:`save_cases_jsonl` (blank lines are skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        return [LineCase.from_json(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------

# A comma-grouped number ("12,345", "1,234,567": groups of exactly three digits) or a plain
# run of ASCII digits. Digits are found anywhere, also glued to letters ("line42" -> 42).
_INT_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+")


def extract_first_integer(text: str) -> int | None:
    """First integer in ``text``, or ``None`` if it has no ASCII digit.

    Rules: leading zeros are dropped ("00123" -> 123); a minus sign is ignored ("-7" -> 7;
    the stored numbers are always positive and line names contain hyphens); comma thousand
    separators in proper groups of three are joined ("12,345" -> 12345, but "12,34" -> 12);
    a decimal point ends the number ("12.5" -> 12); digits inside words count ("line42"
    -> 42); non-ASCII digits are not recognised.
    """
    m = _INT_RE.search(text)
    if m is None:
        return None
    return int(m.group(0).replace(",", ""))


def score_answer(generated_text: str, answer: str | int) -> bool:
    """True iff the first integer of ``generated_text`` equals ``answer`` as an integer."""
    got = extract_first_integer(generated_text)
    return got is not None and got == int(answer)


# ---------------------------------------------------------------------------------------
# Synthetic training data
# ---------------------------------------------------------------------------------------


def make_synthetic_example(
    tokenizer: Any,
    seq_len: int,
    depth: float,
    seed: int,
    loss_on: Literal["answer", "all"] = "answer",
    chat_template: bool | None = None,
) -> dict[str, list[int]]:
    """One training example: prompt + " " + answer + EOS with at most ``seq_len`` tokens.

    ``labels`` are -100 except on the tokens covering " answer" and the EOS
    (``loss_on="answer"``), or equal to ``input_ids`` (``loss_on="all"``).
    """
    if loss_on not in ("answer", "all"):
        raise ValueError(f"loss_on must be 'answer' or 'all', got {loss_on!r}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id")
    use_template = _has_chat_template(tokenizer) if chat_template is None else chat_template
    reserve = len(tokenizer(f" {MAX_NUMBER}", add_special_tokens=False)["input_ids"]) + 1
    budget = seq_len - reserve
    for _ in range(16):
        stream, _n, idx, prompt, _ = _build_case(tokenizer, budget, depth, seed, use_template)
        answer = str(stream.numbers[idx])
        text = prompt + " " + answer
        enc = tokenizer(
            text,
            add_special_tokens=not use_template,
            return_offsets_mapping=True,
            verbose=False,
        )
        ids = list(enc["input_ids"]) + [eos]
        if len(ids) <= seq_len:
            break
        budget -= len(ids) - seq_len
    else:  # pragma: no cover - would need a pathological tokenizer
        raise RuntimeError("could not fit a synthetic example into seq_len")
    if loss_on == "all":
        labels = list(ids)
    else:
        start = len(prompt)
        labels = [
            tok if (e > start and e > s) else -100
            for tok, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        ]
        labels.append(eos)
    return {"input_ids": ids, "labels": labels}


def make_synthetic_dataset(
    tokenizer: Any,
    num_examples: int,
    seq_len: int,
    seed: int,
    loss_on: Literal["answer", "all"] = "answer",
    min_len: int | None = None,
    chat_template: bool | None = None,
    progress: bool = False,
) -> Any:
    """A ``datasets.Dataset`` of line-retrieval examples with ``input_ids`` and ``labels``.

    Example ``i`` uses seed ``derive_seed("synthetic", seed, i)``, a uniform random depth
    and a length budget drawn uniformly from ``[min_len, seq_len]`` (``min_len`` defaults
    to ``seq_len``); actual lengths are at most the budget, within about one line of it.
    """
    import datasets

    lo = seq_len if min_len is None else min_len
    if not 0 < lo <= seq_len:
        raise ValueError("need 0 < min_len <= seq_len")
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    iterator: Iterable[int] = range(num_examples)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="synthetic", total=num_examples)
    for i in iterator:
        ex_seed = derive_seed("synthetic", seed, i)
        rng = random.Random(ex_seed)
        budget = rng.randint(lo, seq_len)
        depth = rng.random()
        ex = make_synthetic_example(tokenizer, budget, depth, ex_seed, loss_on, chat_template)
        rows["input_ids"].append(ex["input_ids"])
        rows["labels"].append(ex["labels"])
    _list_feature = getattr(datasets, "List", None) or datasets.Sequence
    features = datasets.Features(
        {
            "input_ids": _list_feature(datasets.Value("int32")),
            "labels": _list_feature(datasets.Value("int32")),
        }
    )
    return datasets.Dataset.from_dict(rows, features=features)
