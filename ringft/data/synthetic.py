"""Synthetic line-retrieval *training* data (no download): records with the answer appended."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any, Literal

from ringft.lines.cases import derive_seed, fit_record
from ringft.lines.text import MAX_NUMBER, has_chat_template


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
