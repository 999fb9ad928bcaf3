"""Loading a text corpus for packing: local ``.jsonl``/``.json``/``.parquet``/``.txt`` files (a file,
a folder or a glob) or a Hugging Face hub dataset, checked before anything is tokenized."""

from __future__ import annotations

import glob
import os
from typing import Any

import datasets

__all__ = ["SUPPORTED_EXTENSIONS", "AnyDataset", "check_source", "check_text_column", "load_corpus"]

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

AnyDataset = datasets.Dataset | datasets.IterableDataset


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


def check_source(source: str) -> None:
    """Check a corpus ``source`` without loading it: a local path must exist and hold
    ``.jsonl``/``.json``/``.parquet``/``.txt`` files of one type. Raises ``ValueError`` naming the
    path otherwise; a hub dataset name passes (it is only checked when loaded)."""
    _resolve_local_files(source)


def _column_names(dataset: AnyDataset) -> list[str]:
    names = dataset.column_names
    if names is None:  # IterableDataset with unknown features: peek at the first row
        first = next(iter(dataset), None)
        names = list(first) if first is not None else []
    return list(names)


def check_text_column(dataset: AnyDataset, text_column: str) -> None:
    """Raise ``ValueError`` naming the available columns when ``text_column`` is not one of them."""
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
    check_text_column(dataset, text_column)
    return dataset
