"""A batch from a transformers / TRL collator -> one CP rank's zigzag shard.

``transformers.Trainer`` and TRL's ``SFTTrainer`` collate whole sequences: ``input_ids`` and
``labels`` ``(batch, seq)``, and either an ``attention_mask`` (padded batches) or restarting
``position_ids`` plus the varlen keys ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``
(padding-free packing: TRL's ``DataCollatorForLanguageModeling(padding_free=True)``, transformers'
``DataCollatorWithFlattening``). :func:`shard_collated_batch` turns such a batch into what one rank
of the ring computes on, exactly as :class:`ringft.RingDataCollator` does for raw examples:

- labels are shifted on the *whole* sequence first (position ``i`` predicts ``labels[i + 1]``,
  transformers' ``ForCausalLMLoss``), or taken as given when the batch carries ``shift_labels``;
- the sequence is padded to a multiple of ``2 * cp_size`` (pad tokens without targets, positions
  continuing the row);
- ``input_ids``, ``position_ids`` and the shifted labels are zigzag-sharded with the same index
  (with ``ulysses_size``, the Ulysses x ring layout: :func:`ringft.ops.sharding.cp_shard`).

Documents stay apart: a packed row's ``position_ids`` restart at 0 for every document (which is
also how transformers masks packed rows in one process); the shard carries each row's global
document offsets as ``cu_seqlens`` (the ring's batch key: no collective to find them). The varlen
keys say the same thing for one flattened row; they are checked against the positions and dropped.

Refused (:class:`BatchRefused`, one line naming the fix): an attention mask that does anything but
mark right padding (the ring is causal per document and has no mask), a target on a masked
position, keys the ring cannot shard, varlen offsets that disagree with the positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ringft.data.collator import pad_sequence_tensors, shard_sequence_tensors
from ringft.ops.documents import cu_seqlens_from_position_ids

__all__ = [
    "RING_COUNTS",
    "RING_LABELS",
    "RING_LENGTH",
    "RING_ROWS",
    "BatchRefused",
    "VARLEN_KEYS",
    "shard_collated_batch",
]

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
DROPPED_KEYS = ("use_cache", "return_dict", "return_loss")
RING_LENGTH = "ring_length"  # the collated sequence length before the ring's padding (int)
RING_LABELS = "ring_labels"  # the collated, unshifted, unsharded labels (kept for predict())
# int64 (3,): tokens as transformers counts them (all, non-padding) and as TRL's SFTTrainer does
RING_COUNTS = "ring_counts"
# bool (batch, seq_local): the rows one process's batch counts (its attention mask; without one,
# every collated position), False on the ring's padding: what a router load-balancing loss averages
RING_ROWS = "ring_rows"


class BatchRefused(ValueError):
    """A collated batch the ring cannot compute exactly (the message names the fix)."""


def _right_padding_only(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool ``(batch, seq)``; refuse anything but ones followed by zeros per row."""
    if mask.dim() != 2:
        raise BatchRefused(
            f"attention_mask of shape {tuple(mask.shape)}: the ring takes no custom attention masks (it is "
            "causal per document); pass a 2-D right-padding mask, or packed rows with restarting position_ids"
        )
    if bool(((mask != 0) & (mask != 1)).any()):
        raise BatchRefused("attention_mask holds values other than 0 and 1: pass a 0/1 right-padding mask")
    keep = mask.bool()
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise BatchRefused(
            "attention_mask marks more than right padding (left padding or holes): the ring drops the mask, "
            "which is exact only for right padding; pad on the right (tokenizer.padding_side = 'right') or "
            "pack without padding (position_ids restarting per document)"
        )
    return keep


def _check_varlen(batch: Mapping[str, Any], positions: torch.Tensor) -> None:
    """``cu_seq_lens_q/k`` must be the document offsets the positions imply (starts where 0)."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten().tolist()
    expected = [*starts, flat.numel()] if starts and starts[0] == 0 else None
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = batch.get(key)
        if cu is None:
            continue
        got = torch.as_tensor(cu).reshape(-1).tolist()
        if got != expected:
            raise BatchRefused(
                f"{key} {got[:6]}... does not match the document starts of position_ids "
                f"{expected and expected[:6]}...: the ring reads documents from position_ids (restarting "
                "at 0 per document); pass consistent varlen keys (TRL / DataCollatorWithFlattening build "
                "both from the same lengths)"
            )


def _shift(batch: Mapping[str, Any], shape: tuple[int, int], ignore_index: int) -> torch.Tensor | None:
    if batch.get("shift_labels") is not None:
        shifted = torch.as_tensor(batch["shift_labels"])
        if tuple(shifted.shape) != shape:
            raise BatchRefused(f"shift_labels {tuple(shifted.shape)} must be shaped like input_ids {shape}")
        return shifted.long()
    labels = batch.get("labels")
    if labels is None:
        return None
    labels = torch.as_tensor(labels)
    if tuple(labels.shape) != shape:
        raise BatchRefused(f"labels {tuple(labels.shape)} must be shaped like input_ids {shape}")
    return torch.nn.functional.pad(labels.long()[:, 1:], (0, 1), value=ignore_index)


def _counts(ids: torch.Tensor, keep: torch.Tensor | None, pad_token_id: int | None) -> torch.Tensor:
    """Tokens of the batch as the trainers count them: all, non-padding, TRL's ``num_tokens``."""
    if keep is not None:
        nonpad = int(keep.sum())
    elif pad_token_id is not None:
        nonpad = int((ids != pad_token_id).sum())
    else:
        nonpad = ids.numel()
    trl = nonpad if keep is not None else ids.shape[1]
    return torch.tensor([ids.numel(), nonpad, trl], dtype=torch.int64)


def shard_collated_batch(
    batch: Mapping[str, Any],
    cp_rank: int,
    cp_size: int,
    pad_token_id: int,
    *,
    ignore_index: int = -100,
    keep_labels: bool = False,
    count_pad_token_id: int | None = None,
    ulysses_size: int = 1,
) -> dict[str, Any]:
    """This rank's shard of a collated ``(batch, seq)`` batch (see the module docstring).

    Returns ``input_ids``, ``position_ids`` (global positions) and, when the batch had targets,
    ``shift_labels`` (also as ``labels``), each ``(batch, seq_pad // cp_size)`` with ``seq_pad``
    the next multiple of ``2 * cp_size``; ``cu_seqlens`` (per row, global offsets ``[0, ...,
    seq_pad]``); :data:`RING_LENGTH` (``seq``), :data:`RING_COUNTS`, :data:`RING_ROWS`, and
    with ``keep_labels`` the unsharded labels as :data:`RING_LABELS`. ``count_pad_token_id``: the
    tokenizer's pad id for the non-padding token count of batches without a mask. ``ulysses_size``:
    shard for CP = Ulysses x ring (:func:`ringft.data.collator.shard_sequence_tensors`). Raises
    :class:`BatchRefused`.
    """
    unknown = sorted(k for k in batch if k not in (*VARLEN_KEYS, *DROPPED_KEYS) and k not in _KNOWN)
    if unknown:
        raise BatchRefused(
            f"batch keys {unknown} cannot be sharded for the ring (it takes input_ids, labels or "
            "shift_labels, position_ids, a right-padding attention_mask and the varlen keys): drop them from "
            "the collator"
        )
    if batch.get("input_ids") is None:
        raise BatchRefused("the batch has no input_ids (inputs_embeds cannot be sharded for the ring)")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise BatchRefused(f"input_ids must be integer (batch, seq), got {tuple(ids.shape)} {ids.dtype}")
    shape = (ids.shape[0], ids.shape[1])
    keep = (
        None
        if batch.get("attention_mask") is None
        else _right_padding_only(torch.as_tensor(batch["attention_mask"]))
    )
    if keep is not None and tuple(keep.shape) != shape:
        raise BatchRefused(f"attention_mask {tuple(keep.shape)} must be shaped like input_ids {shape}")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(shape[1]).expand(shape)
    positions = torch.as_tensor(positions).long().expand(shape)
    _check_varlen(batch, positions)
    shifted = _shift(batch, shape, ignore_index)
    if shifted is not None and keep is not None and bool((shifted[~keep] != ignore_index).any()):
        raise BatchRefused(
            "a padded position (attention_mask 0) has a target: set its label to -100 (the ring computes no "
            "masked rows; transformers' collators label padding -100)"
        )
    full = {"input_ids": ids.long(), "position_ids": positions}
    if shifted is not None:
        full["shift_labels"] = shifted
    padded = pad_sequence_tensors(full, cp_size, pad_token_id, ignore_index)
    counted = torch.ones(shape, dtype=torch.bool) if keep is None else keep
    padded[RING_ROWS] = torch.nn.functional.pad(counted, (0, padded["input_ids"].shape[1] - shape[1]))
    padded["cu_seqlens"] = cu_seqlens_from_position_ids(padded["position_ids"])
    out: dict[str, Any] = shard_sequence_tensors(padded, cp_rank, cp_size, ulysses_size)
    if shifted is not None:
        out["labels"] = out["shift_labels"]
    out[RING_LENGTH] = shape[1]
    out[RING_COUNTS] = _counts(ids, keep, count_pad_token_id)
    if keep_labels and batch.get("labels") is not None:
        out[RING_LABELS] = torch.as_tensor(batch["labels"])
    return out


_KNOWN = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
