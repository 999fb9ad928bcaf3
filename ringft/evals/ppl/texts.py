"""The documents of ``ringft eval-ppl`` / ``ringft eval-short``: ``--text`` files, globs or a
``datasets.save_to_disk`` folder, tokenized and cut to the evaluated length.

A plain file is one document; a ``.jsonl`` file holds one document per line (its ``--text-field``,
default ``text``); a ``save_to_disk`` folder one per row (the same field). Documents are tokenized
with the tokenizer's special tokens (a BOS where it adds one) and each one's first ``length``
tokens are evaluated. A document shorter than that is refused, naming it, unless ``--concat``
joins all documents (EOS between them) and cuts the stream into consecutive pieces of ``length``
tokens (the tail is dropped).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringft.evals.checks import EvalInputError, check_positive
from ringft.evals.task import Options

_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class TextOptions(Options):
    """The options of a task that reads documents (eval-ppl, eval-short): :func:`add_text_arguments`."""

    text: tuple[str, ...]
    text_field: str
    concat: bool
    num_docs: int | None
    chunk_size: int


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """``--text``, ``--text-field``, ``--concat``, ``--num-docs``, ``--chunk-size`` (eval-ppl, eval-short)."""
    parser.add_argument(
        "--text", nargs="+", required=True, help="files, globs or a datasets.save_to_disk folder"
    )
    parser.add_argument("--text-field", default="text", help="the text column of .jsonl files / datasets")
    parser.add_argument("--concat", action="store_true", help="join the documents and cut the stream instead")
    parser.add_argument("--num-docs", type=int, default=None, help="evaluate at most this many documents")
    parser.add_argument(
        "--chunk-size", type=int, default=1024, help="tokens per chunk of logits (default 1024)"
    )


def check_text_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``--num-docs`` and ``--chunk-size`` positive; the parsed fields of :class:`TextOptions`."""
    if args.num_docs is not None:
        check_positive("--num-docs", args.num_docs, "document")
    check_positive("--chunk-size", args.chunk_size, "token per chunk")
    return {"text": tuple(args.text)}


@dataclass(frozen=True)
class Document:
    """One evaluated token sequence: its ``name`` (file, ``file:line``, ``folder[row]`` or
    ``concat[i]``) and its ``ids``."""

    name: str
    ids: tuple[int, ...]

    @property
    def digest(self) -> str:
        """A short hash of the ids (results are keyed by it)."""
        return hashlib.sha256(json.dumps(self.ids).encode()).hexdigest()[:16]


def _dataset_rows(folder: Path, field: str) -> Iterator[tuple[str, str]]:
    from datasets import Dataset, load_from_disk

    data = load_from_disk(str(folder))
    if not isinstance(data, Dataset):
        splits = ", ".join(data)
        raise EvalInputError(f"--text {folder}: a dataset with splits ({splits}); give one split's folder")
    if field not in data.column_names:
        raise EvalInputError(
            f"--text {folder}: no column {field!r} (columns: {', '.join(data.column_names)}); "
            "choose --text-field"
        )
    for i, text in enumerate(data[field]):
        yield f"{folder}[{i}]", text


def _file_rows(path: Path, field: str) -> Iterator[tuple[str, str]]:
    if path.suffix != ".jsonl":
        yield str(path), path.read_text(encoding="utf-8", errors="replace")
        return
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row[field]
                if not isinstance(text, str):
                    raise TypeError(f"{field!r} is not a string")
            except (ValueError, KeyError, TypeError) as exc:
                raise EvalInputError(
                    f"--text {path} line {number}: no text field {field!r} ({exc})"
                ) from None
            yield f"{path}:{number}", text


def read_texts(specs: Sequence[str], field: str = "text") -> list[tuple[str, str]]:
    """``(name, text)`` of every document named by ``--text`` (files, globs, save_to_disk folders),
    in order; EvalInputError naming a spec that matches nothing."""
    if not specs:
        raise EvalInputError("--text: give at least one file, glob or save_to_disk folder")
    texts: list[tuple[str, str]] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir():
            if not any((path / m).is_file() for m in _DATASET_MARKERS):
                raise EvalInputError(
                    f"--text {spec}: a folder but not a datasets.save_to_disk folder (no dataset_info.json); "
                    "give files, a glob (quoted) or such a folder"
                )
            texts += _dataset_rows(path, field)
        elif path.is_file():
            texts += _file_rows(path, field)
        else:
            matches = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise EvalInputError(f"--text {spec}: no such file, folder or matching glob")
            for match in matches:
                texts += _file_rows(Path(match), field)
    if not texts:
        raise EvalInputError(f"--text {' '.join(specs)}: no documents found")
    return texts


def _names(items: Sequence[tuple[str, int]], limit: int = 3) -> str:
    shown = ", ".join(f"{name} ({count} tokens)" for name, count in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def make_documents(
    texts: Sequence[tuple[str, str]],
    tokenizer: Any,
    length: int,
    *,
    concat: bool = False,
    max_docs: int | None = None,
    flag: str = "--lengths",
) -> list[Document]:
    """Documents of exactly ``length`` tokens (see the module doc); at most ``max_docs``.
    EvalInputError naming the documents shorter than ``length`` (without ``concat``), or when all of
    them together are shorter (with it)."""
    encoded = [(name, list(tokenizer(text, add_special_tokens=True)["input_ids"])) for name, text in texts]
    if not concat:
        short = [(name, len(ids)) for name, ids in encoded if len(ids) < length]
        if short:
            raise EvalInputError(
                f"{flag}: {len(short)} of {len(encoded)} documents are shorter than {length} tokens: "
                f"{_names(short)}; give longer documents, a smaller length, or --concat to join them"
            )
        docs = [Document(name, tuple(ids[:length])) for name, ids in encoded]
    else:
        eos = tokenizer.eos_token_id
        stream: list[int] = []
        for _, ids in encoded:
            stream += ids
            if eos is not None and (not ids or ids[-1] != eos):
                stream.append(eos)
        if len(stream) < length:
            raise EvalInputError(
                f"{flag}: the {len(encoded)} documents joined (--concat) have {len(stream)} tokens, fewer "
                f"than {length}: give more text or a smaller length"
            )
        docs = [
            Document(f"concat[{i}]", tuple(stream[i * length : (i + 1) * length]))
            for i in range(len(stream) // length)
        ]
    return docs[:max_docs] if max_docs is not None else docs
