"""Corpus packing: tokenize documents and cut the token stream into fixed-length sequences.

Documents are tokenized without special tokens and concatenated as
``doc0 EOS doc1 EOS doc2 EOS ...`` (no BOS is inserted anywhere). The stream is cut into
rows of exactly ``seq_len`` tokens; the final tail shorter than ``seq_len`` is dropped and
reported in :class:`PackSummary`. Packing is incremental: only one batch of tokenized
documents plus less than one sequence of carry-over is held in memory at a time, so
streaming (``IterableDataset``) corpora of any size can be packed.
"""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

import datasets
import numpy as np

__all__ = [
    "PackSummary",
    "SUPPORTED_EXTENSIONS",
    "iter_packed_sequences",
    "load_corpus",
    "pack_dataset",
]

#: File extension -> ``datasets`` builder used by :func:`load_corpus`.
SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
}

# Extensions that make a non-existent ``source`` look like a (missing) local path rather than
# a hub dataset name.
_PATHLIKE_EXTENSIONS = set(SUPPORTED_EXTENSIONS) | {
    ".csv",
    ".tsv",
    ".arrow",
    ".gz",
    ".zst",
    ".xz",
    ".bz2",
    ".zip",
    ".tar",
}

_FEATURES = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
_TOKEN_BATCH_FEATURES = datasets.Features({"ids": datasets.List(datasets.Value("int32"))})

# Aim for about this many tokens per Arrow write batch so that very long rows do not pile up
# in the writer's buffer (its default is 1000 rows regardless of row size).
_WRITER_TOKENS = 1 << 20

AnyDataset = datasets.Dataset | datasets.IterableDataset


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
# Loading


def _builder_for(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    try:
        return SUPPORTED_EXTENSIONS[ext]
    except KeyError:
        raise ValueError(
            f"unsupported file extension {ext or '(none)'!r} for {path!r}; "
            f"expected one of {', '.join(SUPPORTED_EXTENSIONS)}"
        ) from None


def _looks_like_path(source: str) -> bool:
    if source.startswith(("/", "./", "../", "~", ".\\")) or source in (".", ".."):
        return True
    return os.path.splitext(source)[1].lower() in _PATHLIKE_EXTENSIONS


def _resolve_local_files(source: str) -> tuple[str, list[str]] | None:
    """Return ``(builder, files)`` for a local source, or None if it looks like a hub name."""
    path = os.path.expanduser(source)
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise ValueError(f"no files match {source!r}")
    elif os.path.isdir(path):
        pattern = os.path.join(glob.escape(path), "**", "*")
        files = sorted(
            p
            for p in glob.glob(pattern, recursive=True)
            if os.path.isfile(p) and os.path.splitext(p)[1].lower() in SUPPORTED_EXTENSIONS
        )
        if not files:
            raise ValueError(f"directory {source!r} contains no {'/'.join(SUPPORTED_EXTENSIONS)} files")
    elif os.path.isfile(path):
        files = [path]
    elif _looks_like_path(source):
        raise ValueError(f"no such file or directory: {source!r}")
    else:
        return None
    builders = {_builder_for(f) for f in files}
    if len(builders) > 1:
        raise ValueError(
            f"{source!r} mixes file types ({', '.join(sorted(builders))}); point it at files of a single type"
        )
    return builders.pop(), files


def _column_names(dataset: AnyDataset) -> list[str]:
    names = dataset.column_names
    if names is None:  # IterableDataset with unknown features: peek at the first row
        first = next(iter(dataset), None)
        names = list(first) if first is not None else []
    return list(names)


def _check_text_column(dataset: AnyDataset, text_column: str) -> None:
    names = _column_names(dataset)
    if text_column not in names:
        raise ValueError(
            f"text column {text_column!r} not found; available columns: "
            f"{', '.join(repr(n) for n in names) or '(none)'}"
        )


def load_corpus(
    source: str,
    *,
    split: str = "train",
    text_column: str = "text",
    streaming: bool = False,
    txt_sample_by: str = "document",
    cache_dir: str | None = None,
) -> AnyDataset:
    """Load a text corpus from local files or the Hugging Face hub.

    ``source`` is a local file, directory (searched recursively) or glob of ``.jsonl``/``.json``,
    ``.parquet`` or ``.txt`` files (all of one type), or else a hub dataset name passed to
    ``datasets.load_dataset``. For ``.txt`` files ``txt_sample_by`` selects what one document
    is: ``"document"`` (a whole file, the default), ``"paragraph"`` or ``"line"``.
    Raises ``ValueError`` for a missing path, an unsupported extension or a missing text column.
    """
    resolved = _resolve_local_files(source)
    if resolved is None:
        dataset = datasets.load_dataset(source, split=split, streaming=streaming, cache_dir=cache_dir)
    else:
        builder, files = resolved
        kwargs: dict[str, Any] = {}
        if builder == "text":
            if txt_sample_by not in ("document", "paragraph", "line"):
                raise ValueError(
                    f"txt_sample_by must be 'document', 'paragraph' or 'line', not {txt_sample_by!r}"
                )
            kwargs["sample_by"] = txt_sample_by
        dataset = datasets.load_dataset(
            builder,
            data_files={split: files},
            split=split,
            streaming=streaming,
            cache_dir=cache_dir,
            **kwargs,
        )
    if not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise ValueError(f"expected a single split from {source!r}, got {type(dataset).__name__}")
    _check_text_column(dataset, text_column)
    return dataset


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
) -> Iterator[np.ndarray]:
    carry = np.empty(0, dtype=np.int32)
    for docs in batches:
        n_tokens = sum(len(d) for d in docs)
        flat = np.fromiter(chain.from_iterable(docs), dtype=np.int32, count=n_tokens)
        stream = np.concatenate([carry, flat]) if len(carry) else flat
        n_seq = len(stream) // seq_len
        summary.documents += len(docs)
        summary.tokens_in += n_tokens
        summary.sequences += n_seq
        summary.tokens_out += n_seq * seq_len
        for i in range(n_seq):
            yield stream[i * seq_len : (i + 1) * seq_len]
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
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_proc is not None and num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc!r}")
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
) -> Iterator[np.ndarray]:
    """Lazily yield packed sequences (int32 arrays of length ``seq_len``).

    Same packing as :func:`pack_dataset`; if ``summary`` is given it is updated in place as
    the iterator advances and is complete once it is exhausted. ``progress`` is called with
    the number of documents consumed after each batch.
    """
    eos_id = _validate(tokenizer, seq_len, add_eos, drop_tail, batch_size, num_proc)
    _check_text_column(dataset, text_column)
    if summary is None:
        summary = PackSummary()
    summary.seq_len = seq_len
    dataset = _limit(dataset, max_documents)
    batches = _token_batches(dataset, tokenizer, text_column, eos_id, batch_size, num_proc)
    return _pack_token_batches(batches, seq_len, summary, progress)


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
    )
    first = next(sequences, None)
    if first is None:  # from_generator cannot build an empty dataset
        return datasets.Dataset.from_dict({"input_ids": []}, features=_FEATURES), summary

    def generate() -> Iterator[dict[str, np.ndarray]]:
        yield {"input_ids": first}
        for seq in sequences:
            yield {"input_ids": seq}

    packed = datasets.Dataset.from_generator(
        generate,
        features=_FEATURES,
        cache_dir=cache_dir,
        # A fresh fingerprint forces the generator to run (and fill `summary`) on every call
        # instead of silently reusing an earlier cached result.
        fingerprint=f"ringft-pack-{uuid.uuid4().hex}",
        writer_batch_size=max(1, _WRITER_TOKENS // seq_len),
    )
    return packed, summary
