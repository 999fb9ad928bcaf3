"""Data collator for context parallelism: pad (or pack), pre-shift labels, zigzag-shard per CP rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringft.data.packer import pack_rows, padding_fraction
from ringft.ops.sharding import cp_shard, ulysses_size_problem, zigzag_padded_length


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
    - ``cu_seqlens``: each row's *global* document offsets ``[0, ..., seq_len]`` (a list of int
      lists, the same on every rank): the ring masks documents apart from them, with no
      collective (:mod:`ringft.model.inputs`); ``[0, seq_len]`` for a row of one example;
    - ``use_cache``: False.

    ``document_masking=True``: every example is an already packed row with its document offsets
    ``"cu_seqlens": [0, ..., len(input_ids)]`` (``data_prep/pack.py --document-masking`` writes them);
    positions and labels then follow the documents as in packing mode.

    ``packing=True`` (needs ``max_length``): the examples are packed into rows of ``max_length``
    tokens by :func:`ringft.data.packer.pack_rows` (best-fit decreasing; documents of any length up
    to ``max_length``, no per-document padding). ``position_ids`` restart at 0 at every document
    (transformers' padding-free convention), labels are shifted *within* each document (its last
    token has no target, so nothing learns to predict the next document), and the row's padding is
    one more document without targets. Inside a row the documents are ordered to even out the CP
    ranks' attention work (:func:`ringft.data.packer.balanced_order`; any order is exact).
    :attr:`last_padding_fraction` and :attr:`last_rows` (example indices per row, in order) describe
    the last packed batch.

    ``ulysses_size`` (default 1: the zigzag ring): 2D context parallelism, ``cp_size = ulysses_size
    x ring_size``; every tensor is sharded with :func:`ringft.ops.sharding.cp_shard` (the ring's
    zigzag shard, cut into ``ulysses_size`` contiguous pieces). The padding rule is the same.

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
        ulysses_size: int = 1,
    ):
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in 0..cp_size-1, got cp_rank={cp_rank}, cp_size={cp_size}")
        problem = ulysses_size_problem(cp_size, ulysses_size)
        if problem:
            raise ValueError(problem)
        self.cp_rank, self.cp_size, self.ulysses_size = cp_rank, cp_size, ulysses_size
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index
        self.pad_to_multiple_of = pad_to_multiple_of
        if max_length is not None and max_length != self.padded_length(max_length):
            raise ValueError(
                f"max_length={max_length} is not a multiple of {self.padded_length(1)} (2 * cp_size"
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
        return zigzag_padded_length(length, self.cp_size, self.pad_to_multiple_of)

    def global_batch(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Padded, shifted, *unsharded* tensors ``(batch, seq_len)`` (what one process would see),
        and ``cu_seqlens``: each row's global document offsets ``[0, ..., seq_len]`` (int lists)."""
        if not examples:
            raise ValueError("RingDataCollator got an empty list of examples")
        ids = [list(map(int, ex["input_ids"])) for ex in examples]
        labels = [list(map(int, ex.get("labels", ex["input_ids"]))) for ex in examples]
        for i, (a, b) in enumerate(zip(ids, labels)):
            if len(a) != len(b):
                raise ValueError(f"example {i}: input_ids ({len(a)}) and labels ({len(b)}) differ in length")
        if self.packing:
            return self._packed_batch(ids, labels)
        longest = max(len(a) for a in ids)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(
                f"an example has {longest} tokens, more than max_length={self.max_length}: truncate or "
                "pack the data to the training length first"
            )
        seq_len = self.max_length or self.padded_length(longest)
        if not self.document_masking:  # one document per row; the padding continues it
            return self._rows([[(a, b)] for a, b in zip(ids, labels)], seq_len, padding_restarts=False)
        rows = []
        for row, ex in enumerate(examples):  # pre-packed rows that carry their document offsets
            cu = _row_document_offsets(ex, len(ids[row]), row)
            rows.append([(ids[row][a:b], labels[row][a:b]) for a, b in zip(cu, cu[1:])])
        return self._rows(rows, seq_len, padding_restarts=True)

    def _packed_batch(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, Any]:
        seq_len = self.max_length
        too_long = [i for i, a in enumerate(ids) if len(a) > seq_len]
        if too_long:
            raise ValueError(
                f"example {too_long[0]} has {len(ids[too_long[0]])} tokens, more than the packed row length "
                f"max_length={seq_len}: truncate or split long documents first"
            )
        lengths = [len(a) for a in ids]
        self.last_rows = pack_rows(lengths, seq_len, self.cp_size // self.ulysses_size)  # balance the ring
        self.last_padding_fraction = padding_fraction(lengths, self.last_rows, seq_len)
        rows = [[(ids[i], labels[i]) for i in members] for members in self.last_rows]
        return self._rows(rows, seq_len, padding_restarts=True)

    def _rows(self, rows: list[list[tuple[list[int], list[int]]]], seq_len: int, padding_restarts: bool):
        """The batch of ``rows``, each a list of documents ``(ids, labels)``: positions restart at 0
        per document (transformers' padding-free convention), labels are shifted *within* each
        document (its last token has no target), and the padding after them is one more document
        without targets (``padding_restarts``) or continues the row's only one."""
        shape = (len(rows), seq_len)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        shift_labels = torch.full(shape, self.ignore_index, dtype=torch.long)
        position_ids = torch.empty(shape, dtype=torch.long)
        cu_seqlens = []
        for r, documents in enumerate(rows):
            at, offsets = 0, [0]
            for doc_ids, doc_labels in documents:
                n = len(doc_ids)
                input_ids[r, at : at + n] = torch.tensor(doc_ids, dtype=torch.long)
                shift_labels[r, at : at + max(n - 1, 0)] = torch.tensor(doc_labels[1:], dtype=torch.long)
                position_ids[r, at : at + n] = torch.arange(n)
                at += n
                offsets += [at] if n else []
            if padding_restarts:
                position_ids[r, at:] = torch.arange(seq_len - at)
                cu_seqlens.append(offsets if at == seq_len else [*offsets, seq_len])
            else:
                position_ids[r, at:] = torch.arange(at, seq_len)
                cu_seqlens.append([0, seq_len])
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "shift_labels": shift_labels,
            "cu_seqlens": cu_seqlens,
        }

    def shard(self, full: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard ``(batch, seq_len // cp_size)`` of every ``(batch, seq_len)`` tensor of
        :meth:`global_batch` (zigzag; :func:`cp_shard` with ``ulysses_size``); ``cu_seqlens``
        (global offsets) stays as it is."""
        return shard_sequence_tensors(full, self.cp_rank, self.cp_size, self.ulysses_size)

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
            "cu_seqlens": local["cu_seqlens"],
            "num_items_in_batch": torch.tensor(max(num_items, 1)),
            "use_cache": False,
        }


def _row_document_offsets(example: dict[str, Any], length: int, row: int) -> list[int]:
    """The document offsets ``[0, ..., length]`` of a pre-packed row (its ``cu_seqlens``)."""
    cu = example.get("cu_seqlens")
    if cu is None:
        raise ValueError(
            f"example {row} has no 'cu_seqlens': document_masking needs rows packed with their document "
            "offsets (data_prep/pack.py --document-masking), or packing=True"
        )
    cu = list(map(int, cu))
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != length or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"example {row}: cu_seqlens must rise strictly from 0 to {length}, got {cu[:8]}")
    return cu


def shard_sequence_tensors(
    full: dict[str, Any], cp_rank: int, cp_size: int, ulysses_size: int = 1
) -> dict[str, Any]:
    """``cp_rank``'s shard ``(batch, seq // cp_size)`` (contiguous) of every ``(batch, seq)`` tensor
    of ``full`` (``seq`` a multiple of ``2 * cp_size``): zigzag, or with ``ulysses_size`` the
    Ulysses x ring layout (:func:`cp_shard`); other values (``cu_seqlens``: global offsets) as they
    are. The one sharding of every batch (this collator's and the trainer mixin's)."""
    return {
        k: cp_shard(v, cp_rank, cp_size, ulysses_size).contiguous() if torch.is_tensor(v) else v
        for k, v in full.items()
    }


def pad_sequence_tensors(
    full: dict[str, torch.Tensor], cp_size: int, pad_token_id: int, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Right-pad ``(batch, seq)`` tensors to the zigzag length of ``cp_size`` (the next multiple of
    ``2 * cp_size``): ``input_ids`` with ``pad_token_id``, ``shift_labels`` / ``labels`` with
    ``ignore_index`` (pads have no target), ``position_ids`` continuing each row (the pads extend
    its last document, after every real token, so no real token attends to them)."""
    seq = next(iter(full.values())).shape[1]
    extra = zigzag_padded_length(seq, cp_size) - seq
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


def pad_and_shard(
    input_ids: Sequence[int], cp_rank: int, cp_size: int, pad_token_id: int = 0, ulysses_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, padded like :class:`RingDataCollator` pads it and sharded for ``cp_rank``
    (zigzag; with ``ulysses_size``, the Ulysses x ring layout): ``(input_ids, position_ids)``, each
    ``(1, padded_len // cp_size)`` int64, where ``padded_len`` is the next multiple of
    ``2 * cp_size``. Pads come after the sequence."""
    collator = RingDataCollator(cp_rank, cp_size, pad_token_id, ulysses_size=ulysses_size)
    local = collator.shard(collator.global_batch([{"input_ids": list(input_ids)}]))
    return local["input_ids"], local["position_ids"]
