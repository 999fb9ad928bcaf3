"""Data collator for context parallelism: pad, pre-shift labels, zigzag-shard per CP rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ringft.sharding import zigzag_shard


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
        return {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        full = self.global_batch(examples)
        num_items = int((full["shift_labels"] != self.ignore_index).sum())
        local = {k: zigzag_shard(v, self.cp_rank, self.cp_size).contiguous() for k, v in full.items()}
        return {
            "input_ids": local["input_ids"],
            "position_ids": local["position_ids"],
            "labels": local["shift_labels"],
            "shift_labels": local["shift_labels"],
            "num_items_in_batch": torch.tensor(max(num_items, 1)),
            "use_cache": False,
        }
