"""Raw SFT records for TRL's ``SFTTrainer`` (``data.format``): loaded, checked, split.

``data.path`` (and ``data.eval_path``) is a ``datasets`` source: a ``save_to_disk`` folder, or a
``.jsonl`` / ``.json`` / ``.parquet`` file (``datasets.load_dataset``). The records' columns follow
TRL's dataset formats:

- ``messages``: a list of ``{"role", "content"}`` turns per record; the tokenizer's chat template
  renders them (``data.assistant_only_loss``: the loss on the assistant turns only, which needs
  ``{% generation %}`` markers in the template, or a template TRL knows how to mark);
- ``prompt_completion``: ``prompt`` and ``completion`` (strings, or turn lists rendered by the chat
  template); the loss on the completion only unless ``data.completion_only_loss: false``;
- ``text``: one string per record in ``data.text_field``.

Checked here, on every rank, before the model loads: the source loads, holds rows and the format's
columns (naming the columns found), holds no ``input_ids`` (pre-tokenized rows: drop the format),
and the tokenizer has the chat template the records need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringft.train.data import held_out_rows
from ringft.train.errors import RecipeError, first_line
from ringft.train.recipe import Recipe

__all__ = ["SftData", "load_sft_data"]

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class SftData:
    """The raw training records (a ``datasets.Dataset``), the eval records (or None), notes."""

    train: Any
    eval: Any = None
    notes: list[str] = field(default_factory=list)


def _load(path: str, key: str) -> Any:
    import datasets

    source = Path(path)
    try:
        if source.is_dir():
            ds = datasets.load_from_disk(path)
        elif source.suffix in FILE_BUILDERS:
            ds = datasets.load_dataset(FILE_BUILDERS[source.suffix], data_files=path, split="train")
        else:
            raise RecipeError(
                f"{key} {path!r}: with data.format give a .jsonl, .json or .parquet file or a datasets "
                "save_to_disk folder"
            )
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken file, a folder save_to_disk did not write, ...
        raise RecipeError(f"{key} {path!r} could not be read as a dataset ({first_line(exc)})") from None
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):
        raise RecipeError(f"{key} {path!r} holds several splits: save one split (a Dataset)")
    if len(ds) == 0:
        raise RecipeError(f"{key} {path!r} holds no records")
    return ds


def _columns(recipe: Recipe) -> tuple[str, ...]:
    fmt = recipe.data.format
    if fmt == "messages":
        return ("messages",)
    return ("prompt", "completion") if fmt == "prompt_completion" else (recipe.data.text_field,)


def _check_records(ds: Any, recipe: Recipe, key: str, path: str) -> None:
    fmt, found = recipe.data.format, ds.column_names
    if "input_ids" in found:
        raise RecipeError(
            f"{key} {path!r} holds input_ids (pre-tokenized rows), which TRL would train on as they are: "
            f"drop data.format to train on them, or give the raw records (data.format={fmt})"
        )
    missing = [c for c in _columns(recipe) if c not in found]
    if missing:
        fix = "set data.text_field to the text column" if fmt == "text" else "rename the columns"
        raise RecipeError(
            f"{key} {path!r} has no {', '.join(missing)} column for data.format={fmt} (columns: {found}): "
            f"{fix}, or choose the format of these records"
        )


def _needs_template(ds: Any, recipe: Recipe) -> bool:
    fmt = recipe.data.format
    if fmt == "messages":
        return True
    return fmt == "prompt_completion" and isinstance(ds[0]["prompt"], list)


def _check_template(tokenizer: Any, recipe: Recipe) -> None:
    """Refuse records the tokenizer's chat template cannot render or mark."""
    name = recipe.model.tokenizer or recipe.model.name_or_path
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"data.format={recipe.data.format} records hold chat turns, and model.tokenizer {name!r} has no "
            "chat template to render them: use a chat model's tokenizer (a folder or hub name with a "
            "chat_template), or give the records as prompt_completion / text strings"
        )
    if not recipe.data.assistant_only_loss:
        return
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        raise RecipeError(
            f"data.assistant_only_loss needs {{% generation %}} markers around the assistant turns in the "
            f"chat template of model.tokenizer {name!r}, which has none (and TRL has no marked copy of it): "
            "add them to the template, or set data.assistant_only_loss: false"
        ) from None


def load_sft_data(recipe: Recipe, tokenizer: Any) -> SftData:
    """The recipe's raw records (``data.path``) and eval split (``data.eval_path``, or
    ``data.eval_fraction`` of the records held out as :func:`ringft.train.data.held_out_rows`
    does), checked (module docstring)."""
    d = recipe.data
    train = _load(d.path, "data.path")
    _check_records(train, recipe, "data.path", d.path)
    evals = None
    if d.eval_path is not None:
        evals = _load(d.eval_path, "data.eval_path")
        _check_records(evals, recipe, "data.eval_path", d.eval_path)
    elif d.eval_fraction:
        train_rows, eval_rows = held_out_rows(recipe, len(train))
        train, evals = train.select(train_rows), train.select(eval_rows)
    if _needs_template(train, recipe):
        _check_template(tokenizer, recipe)
    notes = [
        f"data: {len(train)} {d.format} records"
        + (f", {len(evals)} for evaluation" if evals is not None else "")
        + f", tokenized by TRL's SFTTrainer ({'packed' if d.packing else 'one per row'}, seq_len {d.seq_len})"
    ]
    return SftData(train, evals, notes)
