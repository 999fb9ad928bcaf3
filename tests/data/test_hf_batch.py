"""Collated transformers / TRL batches -> one CP rank's shard (ringft.data.hf_batch): the same
padding, label shift, sharding and document offsets as RingDataCollator, and clear refusals.

Everything here is integer bookkeeping (no floats): results are compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from ringft import RingDataCollator, cp_unshard
from ringft.data.hf_batch import RING_COUNTS, RING_LABELS, RING_LENGTH, BatchRefused, shard_collated_batch

PAD = 0


def _examples() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, prompt in ((13, 4), (9, 0), (6, 2)):
        ids = torch.randint(3, 300, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _right_padded(rows: list[dict]) -> dict[str, torch.Tensor]:
    """What transformers' DataCollatorForSeq2Seq returns (right padding, labels padded with -100)."""
    n = max(len(r["input_ids"]) for r in rows)
    out = {
        "input_ids": torch.full((len(rows), n), PAD),
        "attention_mask": torch.zeros(len(rows), n, dtype=torch.long),
        "labels": torch.full((len(rows), n), -100),
    }
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        out["input_ids"][i, :k] = torch.tensor(r["input_ids"])
        out["attention_mask"][i, :k] = 1
        out["labels"][i, :k] = torch.tensor(r["labels"])
    return out


def _unshard(shards: list[dict], key: str) -> torch.Tensor:
    return cp_unshard([s[key] for s in shards])


@pytest.mark.parametrize("cp, ulysses", [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3)])
def test_padded_rows_shard_like_the_ring_collator(cp, ulysses):
    """A right-padded batch gives exactly RingDataCollator's shards of the same examples (with
    ``ulysses_size``: the Ulysses x ring layout)."""
    rows = _examples()
    batch = _right_padded(rows)
    for rank in range(cp):
        got = shard_collated_batch(batch, rank, cp, PAD, ulysses_size=ulysses)
        want = RingDataCollator(rank, cp, PAD, ulysses_size=ulysses)(rows)
        for key in ("input_ids", "position_ids", "shift_labels", "labels", "cu_seqlens"):
            assert (got[key] == want[key]) if key == "cu_seqlens" else torch.equal(got[key], want[key]), key
        assert got[RING_LENGTH] == 13
        assert got[RING_COUNTS].tolist() == [3 * 13, 13 + 9 + 6, 13 + 9 + 6]  # all, non-padding, TRL's
        assert RING_LABELS not in got


def test_shift_is_on_the_whole_sequence_before_sharding():
    """Position i's target is labels[i + 1] of the unsharded row: none is lost at a chunk edge."""
    batch = _right_padded(_examples())
    shards = [shard_collated_batch(batch, r, 2, PAD, keep_labels=True) for r in range(2)]
    shifted = _unshard(shards, "shift_labels")
    labels = batch["labels"]
    assert torch.equal(shifted[:, : labels.shape[1] - 1], labels[:, 1:])
    assert (shifted[:, labels.shape[1] - 1 :] == -100).all()
    assert torch.equal(shards[0][RING_LABELS], labels)  # kept, unsharded, for predict()
    positions = _unshard(shards, "position_ids")
    assert torch.equal(positions, torch.arange(16).expand(3, 16))  # padded to 2 * 2 * 4, continuing


def _flattened() -> dict:
    from transformers import DataCollatorWithFlattening

    rows = _examples()
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(rows)


@pytest.mark.parametrize("cp", [2, 3])
def test_padding_free_rows_keep_their_documents(cp):
    """DataCollatorWithFlattening / TRL padding-free rows: the documents' offsets reach the ring as
    cu_seqlens (the padding extends the last document), the varlen keys are dropped, and no target
    crosses a boundary (the collator labels each document's first token -100)."""
    flat = _flattened()
    shards = [shard_collated_batch(flat, r, cp, PAD) for r in range(cp)]
    padded = -(-28 // (2 * cp)) * 2 * cp
    assert all(s["cu_seqlens"] == [[0, 13, 22, padded]] for s in shards)
    assert not any(k.startswith(("cu_seq_lens", "max_length", "seq_idx")) for k in shards[0])
    positions = _unshard(shards, "position_ids")[0]
    assert positions[:28].tolist() == list(range(13)) + list(range(9)) + list(range(6))
    shifted = _unshard(shards, "shift_labels")[0]
    assert shifted[12].item() == -100 and shifted[21].item() == -100  # last token of each document
    assert shards[0][RING_COUNTS].tolist() == [28, 28, 28]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.update(attention_mask=b["attention_mask"].flip(1)), "right padding"),
        (lambda b: b["attention_mask"].__setitem__((0, 3), 0), "right padding"),
        (
            lambda b: b.update(attention_mask=b["attention_mask"][:, None, None, :]),
            "no custom attention masks",
        ),
        (lambda b: b.update(attention_mask=b["attention_mask"] * 2), "other than 0 and 1"),
        (lambda b: b["labels"].__setitem__((1, 10), 7), "padded position"),
        (lambda b: b.update(token_type_ids=torch.zeros_like(b["input_ids"])), "token_type_ids"),
        (lambda b: b.update(input_ids=None), "no input_ids"),
        (lambda b: b.update(labels=b["labels"][:, :-1]), "shaped like input_ids"),
    ],
)
def test_refused_padded_batches(change, message):
    batch = _right_padded(_examples())
    change(batch)
    with pytest.raises(BatchRefused, match=message):
        shard_collated_batch(batch, 0, 2, PAD)


def test_varlen_offsets_must_match_the_positions():
    flat = _flattened()
    flat["cu_seq_lens_q"] = torch.tensor([0, 13, 20, 28], dtype=torch.int32)
    with pytest.raises(BatchRefused, match="cu_seq_lens_q .* does not match the document starts"):
        shard_collated_batch(flat, 0, 2, PAD)
