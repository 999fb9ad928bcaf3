"""RULER's variable tracking, ``vt`` (``scripts/data/synthetic/variable_tracking.py``).

One chain of ``num_hops = 4`` hops hides in the noise haystack (one noise sentence a line):
``"VAR ABCDE = 12345"``, then ``"VAR FGHIJ = VAR ABCDE "`` (RULER's trailing space kept) and so on,
in order, on ``sorted(random.sample(range(n), 5))`` lines. Names are 5 random capital letters, the
value a 5-digit number (``np.random.randint(10000, 99999)``); the question asks for every variable
holding the value, and the references are the 5 names.

RULER prepends one solved example (its ``add_fewshot`` default): a chain with 3-letter names and the
value 12345 in as many noise lines as fit in 500 tokens (``tokenizer.tokenize``, no chat template,
template and answer prefix included), followed by its answer. Each sample renames the example's
variables and replaces its value at random, keeping its layout, as RULER's ``randomize_icl`` does.

Deviations: per-sample seeds (see :mod:`ringft.evals.long_tasks.niah`); names are drawn distinct
(RULER's redraw loop can, with probability about 1e-6, keep a duplicate); the example's names are
rendered in place instead of RULER's text replacement (same text unless a new name collides with
another string of the example, which RULER then corrupts).
"""

from __future__ import annotations

import random
import string
from typing import Any

from ringft.data.fit import largest_fitting
from ringft.data.seeds import derive_seed
from ringft.evals.long_tasks.haystack import NOISE
from ringft.evals.long_tasks.prompt import Rendered
from ringft.evals.long_tasks.sample import TaskRequest

__all__ = ["VT_ANSWER_PREFIX", "VT_TEMPLATE", "build_variable_tracking", "fit_icl_noise"]

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assigned the value {query}, they are: "
)
NUM_HOPS = 4
ICL_TOKENS = 500  # RULER fits its one-shot example to this many tokens
ICL_VALUE = 12345


def _names(rng: random.Random, count: int, letters: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def _chain(names: list[str], value: int) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(NUM_HOPS)]


def _context(n: int, chain: list[str], positions: list[int]) -> str:
    """RULER's noise context: ``chain[j]`` inserted at ``positions[j] + j`` (positions sorted)."""
    lines = [NOISE] * n
    for j, position in enumerate(positions):
        lines.insert(position + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def _task_text(context: str, value: int) -> tuple[str, str]:
    body = VT_TEMPLATE.format(context=context, query=value, num_v=NUM_HOPS + 1)
    return body, VT_ANSWER_PREFIX.format(query=value, num_v=NUM_HOPS + 1)


def fit_icl_noise(tokenizer: Any, seed: int) -> tuple[int, list[int]]:
    """``(noise lines, chain positions)`` of the one-shot example: the most lines (at least 5, as
    RULER's search starts there) whose example text has at most 500 tokens. Depends only on the
    tokenizer and the run seed (RULER makes it once per run)."""
    rng = random.Random(derive_seed("vt-icl", seed))
    names = _names(rng, NUM_HOPS + 1, 3)
    layout_seed = rng.getrandbits(63)

    def positions(n: int) -> list[int]:
        return sorted(random.Random(layout_seed).sample(range(n), NUM_HOPS + 1))

    def fits(n: int) -> bool:
        body, prefix = _task_text(_context(n, _chain(names, ICL_VALUE), positions(n)), ICL_VALUE)
        return len(tokenizer(body + prefix, add_special_tokens=False)["input_ids"]) <= ICL_TOKENS

    low = NUM_HOPS + 1
    n = largest_fitting(fits, 4 * low, low) if fits(low) else low
    return n, positions(n)


def build_variable_tracking(request: TaskRequest):
    """Builder for ``vt``: size = noise lines of the question's haystack (at least 5)."""
    if request.depth is not None:
        raise ValueError(f"{request.task}: a needle depth applies to single-needle tasks, vt hides a chain")
    rng = random.Random(request.sample_seed)
    icl_lines, icl_positions = fit_icl_noise(request.tokenizer, request.seed)
    icl_names, icl_value = _names(rng, NUM_HOPS + 1, 3), rng.randint(10000, 99998)
    icl_body, icl_prefix = _task_text(
        _context(icl_lines, _chain(icl_names, icl_value), icl_positions), icl_value
    )
    example = f"{icl_body}{icl_prefix} {' '.join(icl_names)}\n"
    names, value = _names(rng, NUM_HOPS + 1, 5), rng.randint(10000, 99998)
    chain = _chain(names, value)
    layout_seed = derive_seed("vt-layout", request.sample_seed)

    def render(n: int) -> Rendered:
        positions = sorted(random.Random(layout_seed).sample(range(n), NUM_HOPS + 1))
        body, prefix = _task_text(_context(n, chain, positions), value)
        return Rendered(example + "\n" + body, prefix, tuple(names), tuple(p / n for p in positions))

    return render, NUM_HOPS + 1
