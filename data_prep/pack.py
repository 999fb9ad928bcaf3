"""Pack a text corpus into fixed-length token sequences and save it with ``save_to_disk``.

Example::

    python data_prep/pack.py --tokenizer meta-llama/Llama-2-7b-hf --source data/books/ \
        --seq-len 32768 --output data/books-32k

``--tokenizer demo`` uses the small tokenizer shipped with ringft (no download). The source and
the output are checked before the tokenizer is loaded, so a wrong path fails at once.

Documents are joined as ``doc0 EOS doc1 EOS ...`` and cut into rows of exactly ``--seq-len``
tokens (column ``input_ids``); the short tail is dropped. ``--document-masking`` adds each row's
document offsets (column ``cu_seqlens``, ``[0, ..., seq_len]``) for per-document attention in
training (recipe key ``data.document_masking: true``). See ``ringft.data.pack_corpus``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

try:
    from ringft.data import pack_corpus as packing
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ringft.data import pack_corpus as packing
from ringft.data.tokenizer import load_tokenizer  # noqa: E402
from ringft.utils.values import parse_tokens  # noqa: E402

SUMMARY_FILE = "pack_summary.json"


def _positive_int(text: str) -> int:
    """A count > 0; token counts take k / M suffixes (``64k``: ringft.utils.values.parse_tokens)."""
    try:
        value = parse_tokens(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(
        description="Tokenize a corpus and pack it into fixed-length sequences.",
    )
    p.add_argument(
        "--tokenizer", required=True, help="tokenizer name or local path, or 'demo' (shipped with ringft)"
    )
    p.add_argument(
        "--source",
        required=True,
        help="hub dataset name, or a local .jsonl/.json/.parquet/.txt file, directory or glob",
    )
    p.add_argument("--seq-len", required=True, type=_positive_int, help="tokens per sequence (64k: 65536)")
    p.add_argument("--output", required=True, help="directory for Dataset.save_to_disk")
    p.add_argument("--text-column", default="text", help="column holding the documents")
    p.add_argument("--split", default="train", help="split to load (default: train)")
    p.add_argument(
        "--streaming",
        action="store_true",
        help="stream the corpus instead of loading it into the datasets cache first",
    )
    p.add_argument(
        "--max-documents", type=_positive_int, default=None, help="only pack the first K documents"
    )
    p.add_argument(
        "--num-proc", type=_positive_int, default=None, help="processes for tokenization (non-streaming only)"
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=1000, help="documents tokenized per batch (default: 1000)"
    )
    p.add_argument(
        "--txt-sample-by",
        choices=("document", "paragraph", "line"),
        default="document",
        help="for .txt sources: one document per file (default), paragraph or line",
    )
    p.add_argument("--no-eos", action="store_true", help="do not append EOS after documents")
    p.add_argument(
        "--document-masking",
        action="store_true",
        help="also write each row's document offsets (column cu_seqlens) so that training "
        "with data.document_masking keeps attention and targets inside documents",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--cache-dir", default=None, help="datasets cache dir for loading --source")
    return p


def _check_output(output: str, overwrite: bool) -> None:
    if os.path.exists(output):
        if not os.path.isdir(output):
            raise ValueError(f"--output {output!r} exists and is not a directory")
        if os.listdir(output) and not overwrite:
            raise ValueError(f"--output {output!r} is not empty (pass --overwrite to replace it)")


def _load_tokenizer(name: str):
    """``"demo"``, a local folder, or a hub name; a path-like name that does not exist is an error
    (without asking the hub)."""
    if name != "demo" and not os.path.exists(os.path.expanduser(name)):
        if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
            raise ValueError(
                f"--tokenizer {name!r}: no such folder; give a tokenizer folder, a hub name or 'demo'"
            )
    try:
        return load_tokenizer(name)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"--tokenizer {name!r} could not be loaded ({first}); give a tokenizer folder, a hub name "
            "or 'demo'"
        ) from exc


def run(args: argparse.Namespace) -> packing.PackSummary:
    """Load, pack and save according to parsed ``args``; return the summary."""
    import datasets
    from tqdm.auto import tqdm

    packing.check_source(args.source)  # cheap checks first: no tokenizer / hub access for a bad path
    _check_output(args.output, args.overwrite)
    tokenizer = _load_tokenizer(args.tokenizer)
    corpus = packing.load_corpus(
        args.source,
        split=args.split,
        text_column=args.text_column,
        streaming=args.streaming,
        txt_sample_by=args.txt_sample_by,
        cache_dir=args.cache_dir,
    )
    total = len(corpus) if isinstance(corpus, datasets.Dataset) else None
    if args.max_documents is not None:
        total = args.max_documents if total is None else min(total, args.max_documents)

    out_parent = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_parent, exist_ok=True)
    # The packed Arrow file is first written to a scratch dir next to the output (same disk),
    # then copied by save_to_disk; the scratch copy is removed afterwards.
    with tempfile.TemporaryDirectory(prefix=".pack-tmp-", dir=out_parent) as scratch:
        bars_were_enabled = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # our own bar counts documents instead
        try:
            with tqdm(total=total, unit="doc", desc="Packing") as bar:
                packed, summary = packing.pack_dataset(
                    corpus,
                    tokenizer,
                    args.seq_len,
                    text_column=args.text_column,
                    add_eos=not args.no_eos,
                    num_proc=args.num_proc,
                    batch_size=args.batch_size,
                    max_documents=args.max_documents,
                    cache_dir=scratch,
                    progress=bar.update,
                    document_masking=args.document_masking,
                )
            if summary.sequences == 0:
                raise ValueError(
                    f"corpus has only {summary.tokens_in} tokens, fewer than --seq-len "
                    f"{args.seq_len}; nothing to write"
                )
            packed.save_to_disk(args.output)
        finally:
            if bars_were_enabled:
                datasets.enable_progress_bars()
        del packed
    meta = {
        **summary.to_dict(),
        "tokenizer": args.tokenizer,
        "source": args.source,
        "split": args.split,
        "text_column": args.text_column,
        "add_eos": not args.no_eos,
        "document_masking": args.document_masking,
    }
    with open(os.path.join(args.output, SUMMARY_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        summary = run(args)
    except (ValueError, OSError) as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message or type(e).__name__}", file=sys.stderr)
        return 1
    print(summary)
    print(f"saved to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
