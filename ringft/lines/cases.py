"""Line-retrieval test cases: a record whose prompt is as long as fits in a token budget.

The target line is placed at a requested relative *depth* (0 = first line, 1 = last line), and
the number of lines is the largest whose tokenized prompt does not exceed the requested length.

Token counting convention: the prompt's tokens are ``encode_prompt(tokenizer, prompt,
chat_template)``, i.e. ``tokenizer(prompt, add_special_tokens=True)`` for raw prompts (so a BOS
is counted when the tokenizer adds one) and ``add_special_tokens=False`` when a chat template was
applied (chat templates write their own BOS as text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.lines.text import (
    _RecordStream,
    apply_template,
    build_record_text,
    encode_prompt,
    has_chat_template,
    name_capacity,
    render_line,
)


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


@dataclass
class FittedRecord:
    """A record fitted to a token budget: ``prompt`` (final text, chat template applied if asked)
    holds ``len(names)`` lines; the question asks for line ``target_index``; ``num_tokens`` is the
    prompt's token count (see the module docstring for the BOS convention)."""

    prompt: str
    names: list[str]
    numbers: list[int]
    target_index: int
    num_tokens: int

    @property
    def answer(self) -> str:
        """The number stored in the asked line, as text."""
        return str(self.numbers[self.target_index])


def fit_record(
    tokenizer: Any, target_tokens: int, depth: float, seed: int, chat_template: bool
) -> FittedRecord:
    """The record with the most lines whose prompt has at most ``target_tokens`` tokens, the asked
    line at relative ``depth`` (0 = first line, 1 = last). Deterministic from ``seed``."""
    stream, n, idx, prompt, num_tokens = _build_case(tokenizer, target_tokens, depth, seed, chat_template)
    return FittedRecord(prompt, list(stream.names[:n]), list(stream.numbers[:n]), idx, num_tokens)


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
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
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
