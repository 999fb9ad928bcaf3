"""The ``data`` section's checks that involve several keys (:class:`ringft.train.recipe.DataConfig`).

Two kinds of data: pre-tokenized rows (``data.path`` folder with ``input_ids``) or synthetic
records, and raw SFT records that TRL's ``SFTTrainer`` tokenizes (``data.format``: the records'
:data:`SFT_FORMATS` shape; its keys ``packing``, ``completion_only_loss``, ``assistant_only_loss``,
``text_field``). Each refused combination is one line naming the fix.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SFT_FORMATS", "data_problem"]

SFT_FORMATS = ("messages", "prompt_completion", "text")


def _sft_keys_set(d: Any) -> list[str]:
    """The SFT keys given a value other than their default."""
    found = [k for k in ("packing", "assistant_only_loss") if getattr(d, k)]
    found += ["completion_only_loss"] if d.completion_only_loss is not None else []
    return found + (["text_field"] if d.text_field != "text" else [])


def _format_problem(d: Any) -> str | None:
    fmt = d.format
    if fmt is None:
        keys = _sft_keys_set(d)
        if keys:
            return (
                f"data.{keys[0]} is a key of raw SFT records (data.format: messages, prompt_completion or "
                "text, tokenized by TRL): set data.format, or drop it for pre-tokenized rows (packed by "
                "data_prep/pack.py, documents kept apart with data.document_masking)"
            )
        return None
    if d.synthetic is not None:
        return (
            f"data.format={fmt} reads raw records at data.path; data.synthetic makes tokenized records "
            "itself: drop data.format, or give the records' file or folder as data.path"
        )
    if d.document_masking:
        return (
            "data.document_masking reads the document offsets of pre-tokenized rows; with data.format TRL "
            "packs the records itself: set data.packing: true (documents packed and masked apart) instead"
        )
    if d.too_long != "truncate":
        return (
            f"data.format={fmt}: TRL cuts a record longer than data.seq_len to its first seq_len tokens "
            "(with data.packing, best-fit packing cuts the overflow); it cannot fail on or drop such "
            "records: set data.too_long: truncate"
        )
    if d.completion_only_loss and fmt != "prompt_completion":
        fix = "data.assistant_only_loss" if fmt == "messages" else "format prompt_completion records"
        return (
            f"data.completion_only_loss masks the prompt of prompt_completion records, and data.format={fmt} "
            f"has no prompt: drop it (for a loss on the answers only: {fix})"
        )
    if d.assistant_only_loss and fmt != "messages":
        return (
            f"data.assistant_only_loss masks every turn but the assistant's in messages records, and "
            f"data.format={fmt} has no turns: drop it"
            + (" (data.completion_only_loss masks the prompt)" if fmt == "prompt_completion" else "")
        )
    if d.text_field != "text" and fmt != "text":
        return f"data.text_field names the column of format text records, not {fmt}: drop it"
    return None


def data_problem(d: Any) -> str | None:
    """Why the ``data`` section ``d`` (a built DataConfig) cannot run, or None."""
    problem = _format_problem(d)
    if problem:
        return problem
    if (d.path is None) == (d.synthetic is None):
        return "set exactly one of data.path (a save_to_disk folder) or data.synthetic"
    if d.eval_path is not None and d.eval_fraction:
        return "set at most one of data.eval_path or data.eval_fraction (the eval split)"
    if d.document_masking and d.synthetic is not None:
        return (
            "data.document_masking needs packed rows with their document offsets (data.path built by "
            "data_prep/pack.py --document-masking); data.synthetic records are one document each: "
            "set data.document_masking: false"
        )
    syn = d.synthetic
    if syn is not None and syn.min_len is not None and syn.min_len > d.seq_len:
        return (
            f"data.synthetic.min_len={syn.min_len} is larger than data.seq_len={d.seq_len}: "
            "lower min_len or raise seq_len"
        )
    return None
