"""``ringft train`` with ``data.format``: raw SFT records through TRL's ``SFTTrainer`` on the ring.

The recipe's ``TrainingArguments`` become an ``SFTConfig`` (:func:`sft_arguments`: the same
values plus ``max_length = data.seq_len``, ``packing``, ``completion_only_loss``,
``assistant_only_loss``, ``dataset_text_field``), and the ring trainer's base class is
``SFTTrainer`` instead of ``Trainer`` (:func:`sft_inputs`); the recipe's data order, decay groups,
schedule and checkpoint verdict are :mod:`ringft.train.front`'s, shared. TRL applies the chat
template, tokenizes, masks the prompt (or every non-assistant turn) with -100 and, with
``data.packing``, packs the records best-fit into rows of ``seq_len`` collated padding-free
(``position_ids`` restarting per document): the ring keeps the documents apart from them.
"""

from __future__ import annotations

from typing import Any

from ringft.train.errors import RecipeError
from ringft.train.recipe import Recipe
from ringft.train.sft_data import load_sft_data

__all__ = ["sft_arguments", "sft_inputs"]


def sft_arguments(recipe: Recipe) -> dict[str, Any]:
    """What :func:`ringft.train.front.training_arguments` adds for ``data.format`` (empty without)."""
    d = recipe.data
    if d.format is None:
        return {}
    from trl import SFTConfig

    return dict(
        arguments_class=SFTConfig,
        max_length=d.seq_len,
        packing=d.packing,  # bfd: padding-free rows, positions restarting per document
        completion_only_loss=d.completion_only_loss,
        assistant_only_loss=d.assistant_only_loss,
        dataset_text_field=d.text_field,
        remove_unused_columns=True,  # TRL's default: the raw record columns stay out of the batches
    )


def sft_inputs(recipe: Recipe, tokenizer: Any, vocab_size: int) -> tuple[type, dict[str, Any], list[str]]:
    """``(SFTTrainer, its dataset keywords, notes)`` for the recipe's raw records (checked);
    ``vocab_size``: the model's embedding rows, which every id of the tokenizer must be below."""
    from trl import SFTTrainer

    if len(tokenizer) > vocab_size:
        raise RecipeError(
            f"model.tokenizer has {len(tokenizer)} tokens and the model {vocab_size} embedding rows: TRL "
            "would tokenize the records into ids the model has no row for; use the model's own tokenizer"
        )
    data = load_sft_data(recipe, tokenizer)
    return SFTTrainer, {"train_dataset": data.train, "eval_dataset": data.eval}, data.notes
