"""Mix packed long documents with line-retrieval records into one training folder.

Reads a folder written by ``data_prep/pack.py`` (column ``input_ids``: rows of exactly ``seq_len``
tokens; the loss is on every token) and one written by ``data_prep/make_synthetic.py`` (columns
``input_ids`` and ``labels``: -100 except the answer), gives the packed rows ``labels`` equal to
their ``input_ids`` (the collator shifts labels), concatenates both, shuffles them with ``--seed``
and saves the result with ``Dataset.save_to_disk``, the format a recipe's ``data.path`` reads::

    python recipes/smollm2_32k/mix_data.py --packed data/smollm2-packed-16k \\
        --lines data/smollm2-lines-16k --output data/smollm2-mix-16k

Errors are one line naming the folder and the fix (exit code 1); nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

COLUMNS = ("input_ids", "labels")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packed", required=True, type=Path, help="a data_prep/pack.py output folder")
    p.add_argument("--lines", required=True, type=Path, help="a data_prep/make_synthetic.py output folder")
    p.add_argument("--output", required=True, type=Path, help="the mixed dataset folder (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle")
    return p.parse_args(argv)


def _load(path: Path, flag: str, needs: tuple[str, ...]):
    import datasets

    if not path.is_dir():
        raise ValueError(f"{flag} {path}: no such folder; build it first (see prepare_data.sh)")
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: not a save_to_disk dataset ({exc})") from None
    missing = [c for c in needs if c not in ds.column_names]
    if missing:
        raise ValueError(f"{flag} {path}: no column(s) {missing} (columns: {ds.column_names})")
    return ds


def mix(packed_dir: Path, lines_dir: Path, seed: int = 0):
    """``(dataset, packed rows, record rows)``: the mixed ``datasets.Dataset`` has columns
    ``input_ids`` and ``labels`` (int32 lists), the packed rows with ``labels == input_ids``, all
    rows shuffled with ``seed``."""
    import datasets

    lines = _load(lines_dir, "--lines", COLUMNS).select_columns(list(COLUMNS))
    packed = _load(packed_dir, "--packed", ("input_ids",)).select_columns(["input_ids"])
    packed = packed.map(
        lambda batch: {"labels": batch["input_ids"]}, batched=True, features=lines.features, desc="labels"
    )
    mixed = datasets.concatenate_datasets([packed, lines.cast(packed.features)]).shuffle(seed=seed)
    return mixed, len(packed), len(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 on success, 1 with one line on stderr on a bad input."""
    args = parse_args(argv)
    if args.output.exists():
        print(f"error: --output {args.output} exists; delete it or choose another folder", file=sys.stderr)
        return 1
    try:
        mixed, num_packed, num_records = mix(args.packed, args.lines, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    mixed.flatten_indices().save_to_disk(str(args.output))
    print(f"{len(mixed)} rows ({num_packed} packed, {num_records} line-retrieval) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
