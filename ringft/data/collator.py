"""Data collator for context parallelism: pad (or pack), pre-shift labels, zigzag-shard per CP rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ringft.ops.documents import balanced_order
from ringft.ops.sharding import zigzag_shard


class RingDataCollator:
    """Collate examples for one CP rank.

    Takes ``[{"input_ids": [...], "labels": [...] (optional)}, ...]`` of varying lengths and returns
    a dict that ``model(**batch)`` accepts, with tensors of shape ``(batch, seq_len // cp_size)``:

    - ``input_ids``: right-padded with ``pad_token_id`` to a common length that is a multiple of
      ``2 * cp_size`` (and of ``pad_to_multiple_of``), then zigzag-sharded;
    - ``position_ids``: the *global* positions of the local tokens (RoPE needs them);
    - ``labels`` / ``shift_labels``: labels shifted by one on the whole sequence *before* sharding
      (so no target is lost at a chunk edge); pads and the last position are ``ignore_index``;
    - ``num_items_in_batch``: number of valid targets in the whole batch (all CP ranks), so each
      rank's ``.loss`` is its share and the shares sum to the batch's mean token loss;
    - ``use_cache``: False.

    ``document_masking=True``: every example is an already packed row with its document offsets
    ``"cu_seqlens": [0, ..., len(input_ids)]`` (``data_prep/pack.py --document-masking`` writes them);
    positions and labels then follow the documents as in packing mode.

    ``packing=True`` (needs ``max_length``): the examples are packed into as few rows of
    ``max_length`` tokens as first-fit decreasing finds, documents of any length up to
    ``max_length`` (no per-document padding). ``position_ids`` restart at 0 at every document
    (transformers' padding-free convention, from which the ring derives the document boundaries),
    labels are shifted *within* each document (its last token has no target, so nothing learns to
    predict the next document), and the row's padding is one more document without targets.
    Inside a row the documents are ordered to even out the CP ranks' attention work
    (:func:`ringft.ops.documents.balanced_order`; any order is exact). :attr:`last_padding_fraction`
    and :attr:`last_rows` (example indices per row, in order) describe the last packed batch.

    Every CP rank of a replica must receive the same examples (same order).
    """

    def __init__(
        self,
        cp_rank: int,
        cp_size: int,
        pad_token_id: int,
        ignore_index: int = -100,
        pad_to_multiple_of: int | None = None,
        max_length: int | None = None,
        packing: bool = False,
        document_masking: bool = False,
    ):
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in 0..cp_size-1, got cp_rank={cp_rank}, cp_size={cp_size}")
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index
        multiple = 2 * cp_size
        if pad_to_multiple_of:
            multiple = multiple * pad_to_multiple_of // math.gcd(multiple, pad_to_multiple_of)
        self.multiple = multiple
        if max_length is not None and max_length % multiple:
            raise ValueError(
                f"max_length={max_length} is not a multiple of {multiple} (2 * cp_size"
                f"{' and pad_to_multiple_of' if pad_to_multiple_of else ''}): choose a multiple"
            )
        self.max_length = max_length
        if packing and max_length is None:
            raise ValueError("packing=True needs max_length (the length of a packed row, e.g. data.seq_len)")
        self.packing = packing
        self.document_masking = document_masking
        self.last_padding_fraction = 0.0
        self.last_rows: list[list[int]] = []

    def padded_length(self, length: int) -> int:
        """The collated sequence length for a longest example of ``length`` tokens."""
        return max(self.multiple, math.ceil(length / self.multiple) * self.multiple)

    def global_batch(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Padded, shifted, *unsharded* tensors ``(batch, seq_len)`` (what one process would see)."""
        if not examples:
            raise ValueError("RingDataCollator got an empty list of examples")
        ids = [list(map(int, ex["input_ids"])) for ex in examples]
        labels = [list(map(int, ex.get("labels", ex["input_ids"]))) for ex in examples]
        for i, (a, b) in enumerate(zip(ids, labels)):
            if len(a) != len(b):
                raise ValueError(f"example {i}: input_ids ({len(a)}) and labels ({len(b)}) differ in length")
        longest = max(len(a) for a in ids)
        if self.packing:
            return self._packed_batch(ids, labels)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(
                f"an example has {longest} tokens, more than max_length={self.max_length}: truncate or "
                "pack the data to the training length first"
            )
        seq_len = self.max_length or self.padded_length(longest)
        input_ids = torch.full((len(ids), seq_len), self.pad_token_id, dtype=torch.long)
        full_labels = torch.full((len(ids), seq_len + 1), self.ignore_index, dtype=torch.long)
        for row, (a, b) in enumerate(zip(ids, labels)):
            input_ids[row, : len(a)] = torch.tensor(a, dtype=torch.long)
            full_labels[row, : len(b)] = torch.tensor(b, dtype=torch.long)
        shift_labels = full_labels[:, 1:].contiguous()  # position i predicts token i+1
        position_ids = torch.arange(seq_len, dtype=torch.long).expand(len(ids), seq_len).contiguous()
        if self.document_masking:  # pre-packed rows that carry their document offsets
            for row, ex in enumerate(examples):
                starts = _row_document_starts(ex, len(ids[row]), row)
                for a, b in zip(starts, [*starts[1:], seq_len]):
                    position_ids[row, a:b] = torch.arange(b - a)
                    shift_labels[row, b - 1] = self.ignore_index  # no target crosses a boundary
        return {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}

    def _packed_batch(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
        seq_len = self.max_length
        too_long = [i for i, a in enumerate(ids) if len(a) > seq_len]
        if too_long:
            raise ValueError(
                f"example {too_long[0]} has {len(ids[too_long[0]])} tokens, more than the packed row length "
                f"max_length={seq_len}: truncate or split long documents first"
            )
        rows = first_fit_decreasing([len(a) for a in ids], seq_len)
        # Any order inside a row is exact; pick one that evens out the zigzag ranks' work.
        rows = [[m[i] for i in balanced_order([len(ids[j]) for j in m], seq_len, self.cp_size)] for m in rows]
        self.last_rows = rows
        shape = (len(rows), seq_len)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        shift_labels = torch.full(shape, self.ignore_index, dtype=torch.long)
        position_ids = torch.empty(shape, dtype=torch.long)
        for r, members in enumerate(rows):
            at = 0
            for i in members:
                n = len(ids[i])
                input_ids[r, at : at + n] = torch.tensor(ids[i], dtype=torch.long)
                shift_labels[r, at : at + n - 1] = torch.tensor(labels[i][1:], dtype=torch.long)
                position_ids[r, at : at + n] = torch.arange(n)
                at += n
            position_ids[r, at:] = torch.arange(seq_len - at)  # the padding: one target-less document
        self.last_padding_fraction = 1.0 - sum(map(len, ids)) / (len(rows) * seq_len)
        return {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's zigzag shard ``(batch, seq_len // cp_size)`` of every ``(batch, seq_len)``
        tensor of :meth:`global_batch`."""
        return shard_sequence_tensors(full, self.cp_rank, self.cp_size)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The model inputs of this CP rank for ``examples`` (see the class docstring)."""
        full = self.global_batch(examples)
        num_items = int((full["shift_labels"] != self.ignore_index).sum())
        local = self.shard(full)
        return {
            "input_ids": local["input_ids"],
            "position_ids": local["position_ids"],
            "labels": local["shift_labels"],
            "shift_labels": local["shift_labels"],
            "num_items_in_batch": torch.tensor(max(num_items, 1)),
            "use_cache": False,
        }


def _row_document_starts(example: dict[str, Any], length: int, row: int) -> list[int]:
    """Document starts of a pre-packed row from its ``cu_seqlens`` (and the padding after it)."""
    cu = example.get("cu_seqlens")
    if cu is None:
        raise ValueError(
            f"example {row} has no 'cu_seqlens': document_masking needs rows packed with their document "
            "offsets (data_prep/pack.py --document-masking), or packing=True"
        )
    cu = list(map(int, cu))
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != length or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"example {row}: cu_seqlens must rise strictly from 0 to {length}, got {cu[:8]}")
    return cu  # the last offset (the row's end) starts the padding, a target-less document


def shard_sequence_tensors(
    full: dict[str, torch.Tensor], cp_rank: int, cp_size: int
) -> dict[str, torch.Tensor]:
    """``cp_rank``'s zigzag shard ``(batch, seq // cp_size)`` (contiguous) of every ``(batch, seq)``
    tensor of ``full`` (``seq`` a multiple of ``2 * cp_size``): the one sharding of every batch."""
    return {k: zigzag_shard(v, cp_rank, cp_size).contiguous() for k, v in full.items()}


def pad_sequence_tensors(
    full: dict[str, torch.Tensor], multiple: int, pad_token_id: int, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Right-pad ``(batch, seq)`` tensors to the next multiple of ``multiple`` (at least one):
    ``input_ids`` with ``pad_token_id``, ``shift_labels`` / ``labels`` with ``ignore_index`` (pads
    have no target), ``position_ids`` continuing each row (the pads extend its last document,
    after every real token, so no real token attends to them)."""
    seq = next(iter(full.values())).shape[1]
    extra = max(multiple, math.ceil(seq / multiple) * multiple) - seq
    if extra == 0:
        return dict(full)
    out = {}
    for key, value in full.items():
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, tail], dim=1)
        else:
            fill = pad_token_id if key == "input_ids" else ignore_index
            out[key] = torch.nn.functional.pad(value, (0, extra), value=fill)
    return out


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items of ``lengths`` (each <= ``capacity``) into bins of ``capacity``: longest first,
    each into the first bin with room. Returns the item indices per bin (deterministic)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return bins


def pad_and_shard(
    input_ids: Sequence[int], cp_rank: int, cp_size: int, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, padded like :class:`RingDataCollator` pads it and zigzag-sharded for
    ``cp_rank``: ``(input_ids, position_ids)``, each ``(1, padded_len // cp_size)`` int64, where
    ``padded_len`` is the next multiple of ``2 * cp_size``. Pads come after the sequence."""
    collator = RingDataCollator(cp_rank, cp_size, pad_token_id)
    local = collator.shard(collator.global_batch([{"input_ids": list(input_ids)}]))
    return local["input_ids"], local["position_ids"]
