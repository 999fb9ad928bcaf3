"""The Ulysses x ring layout's index math (one process): token ownership, K/V replication, checks."""

from __future__ import annotations

import math

import pytest
import torch

from ringft.ops.sharding import (
    cp_coordinates,
    cp_position_ids,
    cp_shard,
    cp_unshard,
    ulysses_size_problem,
    zigzag_length_problem,
)
from ringft.ops.ulysses import heads_problem, kv_replication, ulysses_sizes_that_work

LAYOUTS = [(cp, u) for cp in (1, 2, 3, 4, 6, 8) for u in range(1, cp + 1) if cp % u == 0]


@pytest.mark.parametrize(("cp", "u"), LAYOUTS)
def test_round_trip_and_ownership(cp, u):
    ring = cp // u
    seq = 2 * cp * 3
    x = torch.arange(2 * seq * 5).view(2, seq, 5)
    shards = [cp_shard(x, c, cp, u) for c in range(cp)]
    assert all(s.shape == (2, seq // cp, 5) for s in shards)
    assert torch.equal(cp_unshard(shards, u), x)
    pos = [cp_position_ids(seq, c, cp, u) for c in range(cp)]
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(seq))
    assert all(torch.all(p[1:] > p[:-1]) for p in pos)  # increasing: local order is global order
    for c in range(cp):
        p, piece = cp_coordinates(c, cp, u)
        assert c == p * u + piece
        # piece `piece` of ring rank p's zigzag shard (chunks p and 2R-1-p of 2R)
        ring_shard = cp_position_ids(seq, p, ring)
        assert torch.equal(pos[c], ring_shard.chunk(u)[piece])
        assert torch.equal(shards[c][0, :, 0], x[0, pos[c], 0])


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_ulysses_one_is_zigzag(cp):
    """With ulysses_size 1 (the default), CP rank c holds chunks c and 2cp-1-c of 2cp."""
    x = torch.randn(2, 4 * cp, 3, 2)
    chunks = x.chunk(2 * cp, dim=1)
    for c in range(cp):
        want = torch.cat([chunks[c], chunks[2 * cp - 1 - c]], dim=1)
        assert torch.equal(cp_shard(x, c, cp, 1), want) and torch.equal(cp_shard(x, c, cp), want)
        assert torch.equal(cp_position_ids(4 * cp, c, cp), cp_shard(torch.arange(4 * cp), c, cp, dim=0))
    shards = [cp_shard(x, c, cp) for c in range(cp)]
    assert torch.equal(cp_unshard(shards, 1), x) and torch.equal(cp_unshard(shards), x)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_one_is_contiguous(cp):
    seq = 2 * cp * 2
    for c in range(cp):
        assert torch.equal(cp_position_ids(seq, c, cp, cp), torch.arange(c * seq // cp, (c + 1) * seq // cp))


def test_divisibility_is_the_rings_rule():
    """S % (2 * cp) == 0 for any split: sufficient (every layout shards it) and the message says so."""
    for cp, u in LAYOUTS:
        assert zigzag_length_problem(2 * cp, cp) is None
        cp_shard(torch.zeros(1, 2 * cp), cp - 1, cp, u)
    assert "not divisible by 2 * cp_size = 8" in zigzag_length_problem(12, 4)
    with pytest.raises(ValueError, match="pad it to a multiple of 8"):
        cp_shard(torch.zeros(1, 12), 0, 4, 2)
    with pytest.raises(ValueError, match=r"ulysses_size=3 does not divide cp_size=4.*\[1, 2, 4\]"):
        cp_shard(torch.zeros(1, 16), 0, 4, 3)
    assert ulysses_size_problem(8, 4) is None and "cp_size must be >= 1" in ulysses_size_problem(0, 1)
    with pytest.raises(ValueError, match="outside"):
        cp_coordinates(4, 4, 2)


@pytest.mark.parametrize("kv", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("u", [1, 2, 3, 4, 6, 8])
def test_kv_replication_is_minimal_and_keeps_gqa(kv, u):
    for heads in (kv * g for g in (1, 2, 3, 4, 6, 8)):
        if heads % u:
            continue
        r = kv_replication(kv, u)
        assert (kv * r) % u == 0 and (heads // kv) % r == 0  # whole heads per rank, GQA groups intact
        assert all((kv * s) % u for s in range(1, r))  # no smaller factor would do
        assert kv * r == math.lcm(kv, u)


def test_heads_refused_with_sizes_that_work():
    assert heads_problem(32, 8) is None
    msg = heads_problem(28, 8, 16)
    assert "query heads (28) are not divisible by ulysses_size=8" in msg and "[1, 2, 4]" in msg
    assert ulysses_sizes_that_work(28) == [1, 2, 4, 7, 14, 28]
    assert ulysses_sizes_that_work(32, 12) == [1, 2, 4]


def test_kv_replication_is_logged_once(caplog):
    """The K/V heads sent to U ranks: repeated in place (GQA order kept), and said once per shape."""
    from ringft.ops.ulysses import _WARNED, _replicate_kv

    _WARNED.discard((3, 2))  # once per process: forget an earlier test's warning
    k = torch.arange(3.0).view(1, 1, 3, 1)
    with caplog.at_level("WARNING", logger="ringft.ops.ulysses"):
        for _ in range(3):
            kr, vr = _replicate_kv(k, k, 2)
        same, _ = _replicate_kv(torch.zeros(1, 1, 4, 1), k, 2)  # 2 divides 4: untouched, not logged
    assert kr.flatten().tolist() == [0, 0, 1, 1, 2, 2] and torch.equal(kr, vr) and same.shape[2] == 4
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "each K/V head is sent 2 times (6 K/V heads, 3 per rank)" in logged[0]
