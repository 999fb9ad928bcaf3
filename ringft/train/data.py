"""The training data: load, check once, hold out an eval split, and the seeded order of each epoch.

Checks at load time, on every rank, before any model is loaded (one vectorised pass over the Arrow
columns, no per-row Python: ``pyarrow.compute.list_value_length`` reads only the row offsets, and the
id range is a chunked ``min_max``):

- rows longer than ``data.seq_len``: refused with their count (``data.too_long: fail``), cut to
  ``seq_len`` when fetched (``truncate``), or left out (``drop``, an in-memory index: nothing is
  written next to the dataset);
- token ids outside ``[0, vocab_size)`` and labels outside it (other than -100): refused;
- ``data.document_masking``: every row needs its document offsets (column ``cu_seqlens``, rising
  strictly from 0 to the row's length, as ``data_prep/pack.py --document-masking`` writes them);
  offsets present while masking is off give a note (attention then crosses documents);
- a dataset that would make batches mostly padding: one warning with the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ringft.train.errors import RecipeError, first_line
from ringft.train.recipe import Recipe

__all__ = [
    "TrainingData",
    "check_rows",
    "epoch_permutation",
    "held_out_rows",
    "load_training_data",
    "split_eval_data",
]

IGNORE_INDEX = -100
PADDING_WARN_FRACTION = 0.5  # warn when more than half of every batch would be padding


@dataclass
class TrainingData:
    """Rows of ``input_ids`` (and optionally ``labels``), each at most ``seq_len`` tokens when read.

    ``notes``: lines for the user (rows truncated or dropped, the padding warning), printed once
    by the main process.
    """

    dataset: Any
    seq_len: int
    truncate: bool = False
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.dataset)

    def examples(self, indices: list[int]) -> list[dict[str, list[int]]]:
        """The rows ``indices`` as ``{"input_ids": [...], "labels": [...]?, "cu_seqlens": [...]?}``
        (cut to ``seq_len``; document offsets past the cut are dropped and ``seq_len`` closes the row)."""
        rows = [self.dataset[i] for i in indices]
        if not self.truncate:
            return rows
        return [_truncated(row, self.seq_len) for row in rows]


def _truncated(row: dict[str, Any], n: int) -> dict[str, Any]:
    out = {k: (v[:n] if k in ("input_ids", "labels") else v) for k, v in row.items()}
    if row.get("cu_seqlens") is not None and len(row["input_ids"]) > n:
        out["cu_seqlens"] = [x for x in row["cu_seqlens"] if x < n] + [n]
    return out


def _column(dataset: Any, name: str):
    """The pyarrow ChunkedArray of column ``name`` (zero-copy for a plain memory-mapped dataset)."""
    return dataset.with_format("arrow")[:][name]


def _check_ids(dataset: Any, name: str, vocab_size: int, where: str, allow_ignore: bool) -> None:
    import pyarrow.compute as pc

    low, high = None, None
    bad_negative = 0
    for chunk in _column(dataset, name).chunks:
        values = pc.list_flatten(chunk)
        if len(values) == 0:
            continue
        if allow_ignore:
            bad_negative += (
                pc.sum(pc.and_(pc.less(values, 0), pc.not_equal(values, IGNORE_INDEX))).as_py() or 0
            )
            values = pc.filter(values, pc.not_equal(values, IGNORE_INDEX))
            if len(values) == 0:
                continue
        mm = pc.min_max(values).as_py()
        low = mm["min"] if low is None else min(low, mm["min"])
        high = mm["max"] if high is None else max(high, mm["max"])
    extra = " or -100" if allow_ignore else ""
    if bad_negative or (low is not None and (low < 0 or high >= vocab_size)):
        raise RecipeError(
            f"{where} column {name!r} holds values in [{low}, {high}], outside [0, {vocab_size}){extra}: the "
            "data was tokenized with another tokenizer than model.tokenizer; re-tokenize it "
            "(data_prep/pack.py)"
        )


def _check_document_offsets(dataset: Any, lengths: np.ndarray, where: str) -> None:
    """Every row's ``cu_seqlens`` rises strictly from 0 to its length (vectorised over the Arrow
    chunks: offsets and values only, no per-row Python)."""
    import pyarrow.compute as pc

    bad, first_bad, row0 = 0, None, 0
    for chunk in _column(dataset, "cu_seqlens").chunks:
        rows = len(chunk)
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        values = chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        count = np.diff(offsets)
        row_of = np.repeat(np.arange(rows), count)
        wrong = (count < 2) | pc.is_null(chunk).to_numpy(zero_copy_only=False)
        has = count > 0
        starts, ends = offsets[:-1][has], offsets[1:][has]
        wrong[has] |= (values[starts] != 0) | (values[ends - 1] != lengths[row0 : row0 + rows][has])
        same_row = row_of[:-1] == row_of[1:]
        wrong[row_of[1:][same_row & (np.diff(values) <= 0)]] = True
        if wrong.any() and first_bad is None:
            i = int(np.flatnonzero(wrong)[0])
            first_bad = (row0 + i, values[offsets[i] : offsets[i + 1]][:8].tolist())
        bad += int(wrong.sum())
        row0 += rows
    if bad:
        raise RecipeError(
            f"{bad} of {len(lengths)} rows of {where} have document offsets (cu_seqlens) that do not rise "
            f"strictly from 0 to the row's length (first: row {first_bad[0]}, {first_bad[1]}): rebuild the "
            "data with data_prep/pack.py --document-masking"
        )


def _check_documents(dataset: Any, recipe: Recipe, lengths: np.ndarray, where: str, notes: list[str]) -> None:
    has_offsets = "cu_seqlens" in dataset.column_names
    if not recipe.data.document_masking:
        if has_offsets:
            notes.append(
                f"data: {where} holds document offsets (cu_seqlens) but data.document_masking is false: "
                "attention and targets cross document boundaries; set data.document_masking: true to keep "
                "documents apart"
            )
        return
    if not has_offsets:
        raise RecipeError(
            f"data.document_masking needs each row's document offsets, but {where} has no cu_seqlens column "
            f"(columns: {dataset.column_names}): build it with data_prep/pack.py --document-masking, or set "
            "data.document_masking: false"
        )
    _check_document_offsets(dataset, lengths, where)


def check_rows(dataset: Any, recipe: Recipe, vocab_size: int, where: str) -> TrainingData:
    """Apply ``data.too_long``, the id-range and document-offset checks to ``dataset``; see the
    module docstring."""
    import pyarrow.compute as pc

    d = recipe.data
    lengths = pc.list_value_length(_column(dataset, "input_ids")).to_numpy(zero_copy_only=False)
    lengths = np.nan_to_num(lengths.astype(np.float64), nan=0.0)  # a null row counts as empty
    if lengths.size == 0:
        raise RecipeError(f"the training dataset {where} is empty")
    data = TrainingData(dataset, d.seq_len)
    _check_documents(dataset, recipe, lengths.astype(np.int64), where, data.notes)
    too_long = np.flatnonzero(lengths > d.seq_len)
    if too_long.size:
        figures = (
            f"{too_long.size} of {lengths.size} rows of {where} are longer than data.seq_len={d.seq_len} "
            f"(longest {int(lengths.max())} tokens)"
        )
        if d.too_long == "fail":
            raise RecipeError(
                f"{figures}: set data.too_long to truncate or drop, pack the data at this length "
                f"(data_prep/pack.py --seq-len {d.seq_len}), or raise data.seq_len"
            )
        if d.too_long == "truncate":
            data.truncate = True
            data.notes.append(
                f"data: {figures}; they are cut to {d.seq_len} tokens (data.too_long: truncate)"
            )
        else:
            keep = np.flatnonzero(lengths <= d.seq_len)
            if keep.size == 0:
                raise RecipeError(f"{figures}: every row would be dropped; raise data.seq_len or truncate")
            data.dataset = dataset.select(keep.tolist(), keep_in_memory=True)
            data.notes.append(f"data: {figures}; they are left out (data.too_long: drop), {keep.size} remain")
            lengths = lengths[keep]
    _check_ids(dataset, "input_ids", vocab_size, where, allow_ignore=False)
    if "labels" in dataset.column_names:
        _check_ids(dataset, "labels", vocab_size, where, allow_ignore=True)
    used = np.minimum(lengths, d.seq_len)
    padding = 1.0 - float(used.mean()) / d.seq_len
    if padding > PADDING_WARN_FRACTION:
        data.notes.append(
            f"warning: rows hold {used.mean():.0f} tokens on average (median {np.median(used):.0f}) and "
            "every "
            f"sequence is padded to data.seq_len={d.seq_len}: about {padding:.0%} of each batch is padding; "
            "pack the data to seq_len (data_prep/pack.py) or lower data.seq_len"
        )
    return data


def _load_folder(path: str, key: str) -> Any:
    from datasets import load_from_disk

    try:
        ds = load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - not a save_to_disk folder, a DatasetDict, ...
        raise RecipeError(
            f"{key} {path!r} is not a datasets save_to_disk folder ({first_line(exc)}): build it with "
            "data_prep/pack.py"
        ) from None
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):
        raise RecipeError(f"{key} {path!r} holds several splits: save one split (a Dataset)")
    if "input_ids" not in ds.column_names:
        raise RecipeError(f"dataset {path!r} has no input_ids column (columns: {ds.column_names})")
    return ds


def held_out_rows(recipe: Recipe, n: int) -> tuple[list[int], list[int]]:
    """``(train rows, eval rows)`` of ``n`` rows with ``data.eval_fraction`` held out: a permutation
    seeded by ``train.seed``, each part in the rows' order."""
    fraction = recipe.data.eval_fraction
    held = int(round(n * fraction))
    if not 1 <= held < n:
        raise RecipeError(
            f"data.eval_fraction={fraction} of {n} rows holds out {held}: choose a fraction that "
            "keeps at least one row on each side"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(recipe.train.seed)).tolist()
    return sorted(order[held:]), sorted(order[:held])


def split_eval_data(
    recipe: Recipe, data: TrainingData, vocab_size: int
) -> tuple[TrainingData, TrainingData | None]:
    """``(train, eval)``: ``data.eval_path`` loaded and checked as the training rows are, or
    ``data.eval_fraction`` of the training rows held out (a permutation seeded by ``train.seed``);
    eval None without either."""
    d = recipe.data
    if d.eval_path is not None:
        return data, check_rows(
            _load_folder(d.eval_path, "data.eval_path"), recipe, vocab_size, repr(d.eval_path)
        )
    if not d.eval_fraction:
        return data, None
    parts = []
    for rows in held_out_rows(recipe, len(data)):
        parts.append(
            TrainingData(data.dataset.select(rows, keep_in_memory=True), data.seq_len, data.truncate)
        )
    return parts[0], parts[1]


def load_training_data(recipe: Recipe, tokenizer: Any, vocab_size: int) -> TrainingData:
    """The recipe's dataset (``data.path`` folder or ``data.synthetic`` records), checked.

    ``vocab_size``: the model's embedding rows (ids must be below it).
    """
    d = recipe.data
    if d.path is not None:
        return check_rows(_load_folder(d.path, "data.path"), recipe, vocab_size, repr(d.path))
    from ringft.data.line_retrieval.training import make_repeat_dataset, make_synthetic_dataset

    syn = d.synthetic
    if syn.task == "repeat":
        ds = make_repeat_dataset(tokenizer, syn.num_examples, d.seq_len, recipe.train.seed)
        return check_rows(ds, recipe, vocab_size, "data.synthetic")
    ds = make_synthetic_dataset(
        tokenizer,
        syn.num_examples,
        d.seq_len,
        recipe.train.seed,
        loss_on=syn.loss_on,
        min_len=syn.min_len,
        questions=syn.questions,
    )
    return check_rows(ds, recipe, vocab_size, "data.synthetic")


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The recipe's shuffled order of ``n`` examples in ``epoch``: ``(n,)`` int64, the same on every rank."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
