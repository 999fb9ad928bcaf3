"""Synthetic *training* data (no download): line-retrieval records with the answer appended, and
repeated random token runs (an induction warm-up for models trained from scratch)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any, Literal

from ringft.data.line_retrieval.record import fit_record
from ringft.data.line_retrieval.text import (
    MAX_NUMBER,
    PREAMBLE,
    QUESTION_TEMPLATE,
    RecordStream,
    render_line,
)
from ringft.data.seeds import derive_seed
from ringft.data.tokenizer import has_chat_template


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
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    reserve = len(tokenizer(f" {MAX_NUMBER}", add_special_tokens=False)["input_ids"]) + 1
    budget = seq_len - reserve
    for _ in range(16):
        record = fit_record(tokenizer, budget, depth, seed, use_template)
        prompt, answer = record.prompt, record.answer
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


LAST_LINE_SHARE = 0.2  # of multi-question records whose first question asks the last line (1 of 5 depths)


def make_multi_question_example(
    tokenizer: Any,
    seq_len: int,
    seed: int,
    questions: int,
    loss_on: Literal["answer", "questions"] = "answer",
) -> dict[str, list[int]]:
    """One multi-question training example of at most ``seq_len`` tokens (ringft prompt style, raw text).

    Layout: ``BOS header line_1 .. line_n`` then up to ``questions`` blocks ``question_j " number_j" EOS``.
    The first block makes the example's prefix exactly an eval record (``ringft eval-lines
    --prompt-style ringft``) followed by its answer; each further block asks a line drawn
    uniformly, with replacement, so one sequence supervises several retrievals. Replacement matters:
    the number just before a question (the last line's, or the previous answer's) must be the answer
    as often as any other; drawn without replacement it never was after the first block, and the
    model learned to skip it (0/8 at depth 100%, benchmarks/history.md). Even so a 2-layer model
    keeps missing the line right before the question, so the first block asks the last line with
    probability ``LAST_LINE_SHARE`` (then uniformly): as often as eval-lines' depth 1.0 asks it.
    ``n`` is drawn uniformly from 1 to the most lines that fit with one question (a curriculum from
    pure copying to choosing among many lines), and as many blocks as fit follow. ``labels`` are
    -100 except on each block's " number" tokens and its EOS (``loss_on="answer"``), or on every
    question and answer token (``loss_on="questions"``: the asked names are then predicted too, by
    finding them among the lines, an induction task that forms the retrieval circuit sooner).
    Pieces are tokenized separately: the demo tokenizer splits at newlines and digits, so the
    concatenation equals the whole text's tokenization (tests/recipes/test_demo.py checks it).
    """
    if questions < 1:
        raise ValueError(f"questions must be >= 1, got {questions}")
    if loss_on not in ("answer", "questions"):
        raise ValueError(f"loss_on must be 'answer' or 'questions', got {loss_on!r}")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None or eos is None:
        raise ValueError("multi-question examples need a tokenizer with bos_token_id and eos_token_id")

    rng = random.Random(seed)
    stream = RecordStream(rng.randrange(1 << 62), 2)
    pool = max(1, seq_len // 15)  # first guess of the most lines that fit (>= 15 tokens in most tokenizers)
    while True:  # grow the pool until the record is limited by seq_len, not by the pool
        head, answer_room, line_ids, question_ids, number_ids = _tokenized_pool(tokenizer, stream, pool)
        lines = _lines_that_fit(head, answer_room, line_ids, question_ids, seq_len)
        if lines < pool:
            break
        pool *= 2
    if not lines:
        raise ValueError(f"seq_len={seq_len} cannot hold one line and one question")
    n = rng.randint(1, lines)
    ids = head + [tok for line in line_ids[:n] for tok in line]
    labels = [-100] * len(ids)
    for block in range(questions):
        first_asks_last = block == 0 and rng.random() < LAST_LINE_SHARE
        asked = n - 1 if first_asks_last else rng.randrange(n)  # with replacement: see the docstring
        answer = [*number_ids[asked], eos]
        if len(ids) + len(question_ids[asked]) + len(answer) > seq_len:
            break
        ids += question_ids[asked] + answer
        asked_labels = question_ids[asked] if loss_on == "questions" else [-100] * len(question_ids[asked])
        labels += asked_labels + answer
    return {"input_ids": ids, "labels": labels}


def _tokenized_pool(
    tokenizer: Any, stream: RecordStream, pool: int
) -> tuple[list[int], int, list, list, list]:
    """Header ids, answer room, and the ids of ``pool`` lines, questions and answers (one batched call)."""
    stream.ensure(pool)
    texts = [PREAMBLE, f" {MAX_NUMBER}"]
    texts += [render_line(a, b) for a, b in zip(stream.names[:pool], stream.numbers[:pool], strict=True)]
    texts += [QUESTION_TEMPLATE.format(name=a) for a in stream.names[:pool]]
    texts += [f" {b}" for b in stream.numbers[:pool]]
    enc = [list(x) for x in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
    head = [tokenizer.bos_token_id, *enc[0]]
    return head, len(enc[1]) + 1, enc[2 : 2 + pool], enc[2 + pool : 2 + 2 * pool], enc[2 + 2 * pool :]


def _lines_that_fit(
    head: list[int], answer_room: int, line_ids: list, question_ids: list, seq_len: int
) -> int:
    """The most leading lines that leave room to ask any one of them (question + answer + EOS)."""
    lines, used, block = 0, len(head), 0
    while lines < len(line_ids):
        asked = len(question_ids[lines]) + answer_room
        if used + len(line_ids[lines]) + max(block, asked) > seq_len:
            break
        used, block = used + len(line_ids[lines]), max(block, asked)
        lines += 1
    return lines


def make_synthetic_dataset(
    tokenizer: Any,
    num_examples: int,
    seq_len: int,
    seed: int,
    loss_on: Literal["answer", "all", "questions"] = "answer",
    min_len: int | None = None,
    chat_template: bool | None = None,
    progress: bool = False,
    questions: int = 1,
) -> Any:
    """A ``datasets.Dataset`` of line-retrieval examples with ``input_ids`` and ``labels``.

    Example ``i`` uses seed ``derive_seed("synthetic", seed, i)``, a uniform random depth
    and a length budget drawn uniformly from ``[min_len, seq_len]`` (``min_len`` defaults
    to ``seq_len``); actual lengths are at most the budget, within about one line of it.
    ``questions > 1`` makes multi-question examples instead (:func:`make_multi_question_example`,
    raw text; ``loss_on`` "answer" or "questions", ``min_len`` and ``chat_template`` unset).
    """
    if questions > 1 and (loss_on == "all" or min_len is not None or chat_template):
        raise ValueError(
            "data.synthetic.questions > 1 makes raw-text records of up to seq_len tokens with the loss on "
            "answers (or questions and answers): use loss_on answer or questions and leave min_len unset"
        )
    if questions == 1 and loss_on == "questions":
        raise ValueError("loss_on='questions' needs questions > 1 (multi-question records)")
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
        if questions > 1:
            ex = make_multi_question_example(tokenizer, seq_len, ex_seed, questions, loss_on)  # type: ignore[arg-type]
            rows["input_ids"].append(ex["input_ids"])
            rows["labels"].append(ex["labels"])
            continue
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


def make_repeat_example(tokenizer: Any, seq_len: int, seed: int) -> dict[str, list[int]]:
    """BOS, a run of ``m`` random non-special tokens, then the same run again (``1 + 2m <= seq_len``,
    ``m`` uniform from 8): ``labels`` are -100 except on the copy's tokens after its first.

    Predicting the copy means finding the current token earlier and reading what followed it: the
    induction circuit. A fresh tiny model forms it here in ~1000 steps, and line retrieval (which
    needs it) then trains in a few thousand instead of not at all (benchmarks/history.md).
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ValueError("repeat examples need a tokenizer with a bos_token_id")
    top = (seq_len - 1) // 2
    if top < 8:
        raise ValueError(f"seq_len={seq_len} is too short for repeat examples (need >= 17)")
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    run = [rng.choice(vocab) for _ in range(rng.randint(8, top))]
    ids = [bos, *run, *run]
    labels = [-100] * (len(run) + 2) + run[1:]
    return {"input_ids": ids, "labels": labels}


def make_repeat_dataset(tokenizer: Any, num_examples: int, seq_len: int, seed: int) -> Any:
    """A ``datasets.Dataset`` of :func:`make_repeat_example` rows (example ``i``: seed
    ``derive_seed("repeat", seed, i)``)."""
    import datasets

    rows = [
        make_repeat_example(tokenizer, seq_len, derive_seed("repeat", seed, i)) for i in range(num_examples)
    ]
    _list_feature = getattr(datasets, "List", None) or datasets.Sequence
    feature = _list_feature(datasets.Value("int32"))
    return datasets.Dataset.from_dict(
        {k: [r[k] for r in rows] for k in ("input_ids", "labels")},
        features=datasets.Features({"input_ids": feature, "labels": feature}),
    )
