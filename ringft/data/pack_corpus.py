"""Corpus packing: tokenize documents and cut the token stream into fixed-length sequences; or
pack tokenized examples into rows with their document offsets (:func:`pack_examples`).

Loading and checking a corpus lives in :mod:`ringft.data.corpus` (re-exported here).

Documents are tokenized without special tokens and concatenated as
``doc0 EOS doc1 EOS doc2 EOS ...`` (no BOS is inserted anywhere). The stream is cut into
rows of exactly ``seq_len`` tokens; the final tail shorter than ``seq_len`` is dropped and
reported in :class:`PackSummary`. Packing is incremental: only one batch of tokenized
documents plus less than one sequence of carry-over is held in memory at a time, so
streaming (``IterableDataset``) corpora of any size can be packed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

import datasets
import numpy as np

from ringft.data.corpus import SUPPORTED_EXTENSIONS, AnyDataset, check_source, check_text_column, load_corpus
from ringft.data.packer import pack_rows, padding_fraction
from ringft.utils.values import as_integer

__all__ = [
    "PackSummary",
    "SUPPORTED_EXTENSIONS",
    "check_source",
    "iter_packed_sequences",
    "pack_examples",
    "load_corpus",
    "pack_dataset",
]

_FEATURES = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
_DOC_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "cu_seqlens": datasets.List(datasets.Value("int32")),  # document offsets in the row
    }
)
_TOKEN_BATCH_FEATURES = datasets.Features({"ids": datasets.List(datasets.Value("int32"))})

# Aim for about this many tokens per Arrow write batch so that very long rows do not pile up
# in the writer's buffer (its default is 1000 rows regardless of row size).
_WRITER_TOKENS = 1 << 20


@dataclass
class PackSummary:
    """Counts describing one packing run.

    ``tokens_in`` includes the appended EOS tokens; ``tokens_out == sequences * seq_len`` and
    ``tokens_in == tokens_out + dropped_tail_tokens``.
    """

    documents: int = 0
    tokens_in: int = 0
    sequences: int = 0
    tokens_out: int = 0
    dropped_tail_tokens: int = 0
    seq_len: int = 0

    def to_dict(self) -> dict[str, int]:
        """Return the summary as a plain dict (e.g. for JSON)."""
        return asdict(self)

    def __str__(self) -> str:
        pct = 100.0 * self.dropped_tail_tokens / self.tokens_in if self.tokens_in else 0.0
        return (
            f"packed {self.documents:,} documents ({self.tokens_in:,} tokens incl. EOS) into "
            f"{self.sequences:,} sequences x {self.seq_len:,} tokens = {self.tokens_out:,} tokens; "
            f"dropped tail: {self.dropped_tail_tokens:,} tokens ({pct:.2f}%)"
        )


# --------------------------------------------------------------------------------------------
# Packing


def _texts(values: list[Any], text_column: str) -> list[str]:
    out = []
    for v in values:
        if v is None:
            v = ""
        elif not isinstance(v, str):
            raise ValueError(f"text column {text_column!r} must hold strings, found {type(v).__name__}")
        out.append(v)
    return out


def _encode(texts: list[str], tokenizer: Any, eos_id: int | None) -> list[list[int]]:
    """Tokenize documents without special tokens, appending ``eos_id`` when it is not None."""
    ids = tokenizer(
        texts,
        add_special_tokens=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )["input_ids"]
    if eos_id is not None:
        for doc in ids:
            doc.append(eos_id)
    return ids


def _encode_batch(
    batch: dict[str, list[Any]], tokenizer: Any, text_column: str, eos_id: int | None
) -> dict[str, list[list[int]]]:
    return {"ids": _encode(_texts(batch[text_column], text_column), tokenizer, eos_id)}


def _limit(dataset: AnyDataset, max_documents: int | None) -> AnyDataset:
    if max_documents is None:
        return dataset
    if max_documents < 0:
        raise ValueError(f"max_documents must be >= 0, got {max_documents}")
    if isinstance(dataset, datasets.Dataset):
        return dataset.select(range(min(max_documents, len(dataset))))
    return dataset.take(max_documents)


def _token_batches(
    dataset: AnyDataset,
    tokenizer: Any,
    text_column: str,
    eos_id: int | None,
    batch_size: int,
    num_proc: int | None,
) -> Iterator[list[list[int]]]:
    """Yield batches of per-document token ids (EOS already appended)."""
    if num_proc is not None and num_proc > 1 and isinstance(dataset, datasets.Dataset):
        tokenized = dataset.map(
            _encode_batch,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc,
            remove_columns=dataset.column_names,
            features=_TOKEN_BATCH_FEATURES,
            fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "eos_id": eos_id},
            desc="Tokenizing",
        )
        for batch in tokenized.iter(batch_size=batch_size):
            yield batch["ids"]
        return
    for batch in dataset.iter(batch_size=batch_size):
        yield _encode(_texts(batch[text_column], text_column), tokenizer, eos_id)


def _pack_token_batches(
    batches: Iterable[list[list[int]]],
    seq_len: int,
    summary: PackSummary,
    progress: Callable[[int], None] | None,
    document_masking: bool = False,
) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
    carry = np.empty(0, dtype=np.int32)
    carry_starts = np.empty(0, dtype=np.int64)  # document starts inside the carry-over
    for docs in batches:
        n_tokens = sum(len(d) for d in docs)
        flat = np.fromiter(chain.from_iterable(docs), dtype=np.int32, count=n_tokens)
        stream = np.concatenate([carry, flat]) if len(carry) else flat
        n_seq = len(stream) // seq_len
        summary.documents += len(docs)
        summary.tokens_in += n_tokens
        summary.sequences += n_seq
        summary.tokens_out += n_seq * seq_len
        if document_masking:
            lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
            starts = np.concatenate([carry_starts, len(carry) + np.cumsum(lengths) - lengths])
        for i in range(n_seq):
            row = stream[i * seq_len : (i + 1) * seq_len]
            if not document_masking:
                yield row
                continue
            inside = starts[(starts > i * seq_len) & (starts < (i + 1) * seq_len)] - i * seq_len
            # A document cut by the row start continues as a document of its own.
            yield row, np.concatenate([[0], inside, [seq_len]]).astype(np.int32)
        if document_masking:
            carry_starts = starts[starts >= n_seq * seq_len] - n_seq * seq_len
        carry = stream[n_seq * seq_len :].copy()
        summary.dropped_tail_tokens = len(carry)
        if progress is not None:
            progress(len(docs))


def _validate(
    tokenizer: Any,
    seq_len: int,
    add_eos: bool,
    drop_tail: bool,
    batch_size: int,
    num_proc: int | None,
) -> int | None:
    """Check arguments; return the EOS id to append (None when ``add_eos`` is False)."""
    as_integer("seq_len", seq_len, 1)
    as_integer("batch_size", batch_size, 1)
    as_integer("num_proc", num_proc, 1, optional=True)
    if not drop_tail:
        raise ValueError(
            "drop_tail=False is not supported: the tail shorter than seq_len is always dropped "
            "(see PackSummary.dropped_tail_tokens)"
        )
    if not add_eos:
        return None
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise ValueError("add_eos=True but the tokenizer has no eos_token_id")
    return int(eos_id)


def iter_packed_sequences(
    dataset: AnyDataset,
    tokenizer: Any,
    seq_len: int,
    *,
    text_column: str = "text",
    add_eos: bool = True,
    drop_tail: bool = True,
    num_proc: int | None = None,
    batch_size: int = 1000,
    max_documents: int | None = None,
    summary: PackSummary | None = None,
    progress: Callable[[int], None] | None = None,
    document_masking: bool = False,
) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
    """Lazily yield packed sequences (int32 arrays of length ``seq_len``).

    Same packing as :func:`pack_dataset`; if ``summary`` is given it is updated in place as
    the iterator advances and is complete once it is exhausted. ``progress`` is called with
    the number of documents consumed after each batch. With ``document_masking`` each item is
    ``(row, cu_seqlens)``: the row's document offsets ``[0, ..., seq_len]`` (int32).
    """
    eos_id = _validate(tokenizer, seq_len, add_eos, drop_tail, batch_size, num_proc)
    check_text_column(dataset, text_column)
    if summary is None:
        summary = PackSummary()
    summary.seq_len = seq_len
    dataset = _limit(dataset, max_documents)
    batches = _token_batches(dataset, tokenizer, text_column, eos_id, batch_size, num_proc)
    return _pack_token_batches(batches, seq_len, summary, progress, document_masking)


def pack_dataset(
    dataset: AnyDataset,
    tokenizer: Any,
    seq_len: int,
    *,
    text_column: str = "text",
    add_eos: bool = True,
    drop_tail: bool = True,
    num_proc: int | None = None,
    batch_size: int = 1000,
    max_documents: int | None = None,
    cache_dir: str | None = None,
    progress: Callable[[int], None] | None = None,
    document_masking: bool = False,
) -> tuple[datasets.Dataset, PackSummary]:
    """Tokenize ``dataset[text_column]`` and pack it into rows of exactly ``seq_len`` tokens.

    Documents are concatenated as ``doc0 EOS doc1 EOS ...`` (EOS only when ``add_eos``; no BOS,
    no other special tokens) and cut into consecutive ``seq_len`` chunks, so documents may span
    row boundaries. The leftover tail is dropped (``drop_tail=False`` is not supported).
    Works on map-style and streaming datasets with bounded memory; ``num_proc > 1`` tokenizes
    a map-style dataset in parallel (ignored for streaming). ``max_documents`` keeps only the
    first K documents; ``cache_dir`` is where the packed Arrow file is written (default: the
    ``datasets`` cache); ``progress`` is called with the number of documents done per batch.
    Returns a ``datasets.Dataset`` with one ``input_ids`` column and a :class:`PackSummary`.
    ``document_masking`` adds a ``cu_seqlens`` column: each row's document offsets
    ``[0, ..., seq_len]`` (a document cut by a row start continues as its own document), which
    ``RingDataCollator(document_masking=True)`` turns into per-document positions and labels.
    """
    summary = PackSummary()
    sequences = iter_packed_sequences(
        dataset,
        tokenizer,
        seq_len,
        text_column=text_column,
        add_eos=add_eos,
        drop_tail=drop_tail,
        num_proc=num_proc,
        batch_size=batch_size,
        max_documents=max_documents,
        summary=summary,
        progress=progress,
        document_masking=document_masking,
    )
    features = _DOC_FEATURES if document_masking else _FEATURES
    first = next(sequences, None)
    if first is None:  # from_generator cannot build an empty dataset
        return datasets.Dataset.from_dict({k: [] for k in features}, features=features), summary

    def record(item) -> dict[str, np.ndarray]:
        return {"input_ids": item[0], "cu_seqlens": item[1]} if document_masking else {"input_ids": item}

    def generate() -> Iterator[dict[str, np.ndarray]]:
        yield record(first)
        for seq in sequences:
            yield record(seq)

    packed = datasets.Dataset.from_generator(
        generate,
        features=features,
        cache_dir=cache_dir,
        # A fresh fingerprint forces the generator to run (and fill `summary`) on every call
        # instead of silently reusing an earlier cached result.
        fingerprint=f"ringft-pack-{uuid.uuid4().hex}",
        writer_batch_size=max(1, _WRITER_TOKENS // seq_len),
    )
    return packed, summary


# --------------------------------------------------------------------------------------------
# Packing tokenized examples (e.g. SFT conversations) with their document offsets


def pack_examples(
    examples: datasets.Dataset, seq_len: int, cp_size: int = 1, ignore_index: int = -100
) -> tuple[datasets.Dataset, float]:
    """Pack tokenized examples into rows of at most ``seq_len`` tokens, with the document offsets
    that ``data.document_masking: true`` trains on (nothing attends or predicts across examples).

    ``examples``: columns ``input_ids`` and optionally ``labels`` (e.g. SFT conversations with the
    prompt set to ``ignore_index``; default: the ids). Rows come from :func:`ringft.data.packer.pack_rows`
    (best-fit decreasing: each example, longest first, goes into the fullest row it fits; no example
    is cut or padded on its own). With ``cp_size > 1`` the examples of each row are ordered to even
    out the zigzag ranks' attention work (:func:`ringft.data.packer.balanced_order`, a few ms of
    host time per row; any order is exact).
    Returns the packed dataset (``input_ids``, ``labels``, ``cu_seqlens`` ``[0, ..., row length]``)
    and its padding fraction at ``seq_len``. Raises ``ValueError`` for an example longer than
    ``seq_len``.
    """
    ids = examples["input_ids"]
    labels = examples["labels"] if "labels" in examples.column_names else ids
    lengths = [len(x) for x in ids]
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} examples are longer than seq_len={seq_len} (first: example {too_long[0]}, "
            f"{lengths[too_long[0]]} tokens): truncate or split them first, or raise seq_len"
        )
    rows = pack_rows(lengths, seq_len, cp_size)
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "cu_seqlens": []}
    for members in rows:
        cu = [0]
        for i in members:
            cu.append(cu[-1] + lengths[i])
        out["input_ids"].append([t for i in members for t in ids[i]])
        out["labels"].append([t for i in members for t in labels[i]])
        out["cu_seqlens"].append(cu)
    padding = padding_fraction(lengths, rows, seq_len)
    return datasets.Dataset.from_dict(out), padding
