"""The one packer (``ringft.data.packer.pack_rows``) and the collator's document rows built from it."""

from __future__ import annotations

import random

import pytest

from ringft import RingDataCollator
from ringft.data.packer import balanced_order, pack_rows, padding_fraction
from ringft.ops.documents import rank_pairs


def test_best_fit_decreasing():
    # Longest first; the 1 goes to the fullest row it fits ({5, 4}: 1 left), not the first ({8}).
    assert pack_rows([5, 8, 1, 7, 4], 10) == [[1], [3], [0, 4, 2]]
    assert pack_rows([30, 25, 20, 10, 5], 48) == [[0, 3, 4], [1, 2]]
    assert pack_rows([], 8) == [] and padding_fraction([], [], 8) == 0.0
    assert padding_fraction([30, 25, 20, 10, 5], [[0, 3, 4], [1, 2]], 48) == pytest.approx(1 - 90 / 96)
    with pytest.raises(ValueError, match="item 1 has 9 tokens, more than a row"):
        pack_rows([3, 9], 8)


def test_rows_are_valid_and_balanced_for_the_ring():
    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(60)]
    plain, ordered = pack_rows(lengths, 256), pack_rows(lengths, 256, cp_size=4)
    assert sorted(i for row in plain for i in row) == list(range(60))
    assert all(sum(lengths[i] for i in row) <= 256 for row in plain)
    assert [sorted(r) for r in ordered] == [sorted(r) for r in plain]  # same rows, balanced order
    for before, after in zip(plain, ordered):
        assert after == [before[j] for j in balanced_order([lengths[i] for i in before], 256, 4)]
        worst = max(rank_pairs([lengths[i] for i in after], 256, 4))
        assert worst <= max(rank_pairs([lengths[i] for i in before], 256, 4))


def test_collator_rows_carry_their_offsets():
    """Pre-packed rows (document_masking) and packed examples give the same positions, labels and
    offsets for the same documents: one builder."""
    docs = [list(range(1, 8)), list(range(20, 25)), list(range(40, 43))]
    labels = [list(d) for d in docs]
    labels[1][:2] = [-100, -100]
    row = {"input_ids": sum(docs, []), "labels": sum(labels, []), "cu_seqlens": [0, 7, 12, 15]}
    pre = RingDataCollator(0, 1, pad_token_id=0, max_length=16, document_masking=True).global_batch([row])
    packer = RingDataCollator(0, 1, pad_token_id=0, max_length=16, packing=True)
    packed = packer.global_batch([{"input_ids": d, "labels": lab} for d, lab in zip(docs, labels)])
    assert packer.last_rows == [[0, 1, 2]]  # longest first, in one row
    assert pre["cu_seqlens"] == packed["cu_seqlens"] == [[0, 7, 12, 15, 16]]
    for key in ("input_ids", "position_ids", "shift_labels"):
        assert pre[key].tolist() == packed[key].tolist(), key
    assert pre["position_ids"][0].tolist() == [*range(7), *range(5), *range(3), 0]
    assert pre["shift_labels"][0].tolist() == [*range(2, 8), -100, -100, 22, 23, 24, -100, 41, 42, -100, -100]
