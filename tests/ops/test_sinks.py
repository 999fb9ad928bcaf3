"""Attention sinks on the ring (:mod:`ringft.ops.sinks`) against an fp64 oracle that puts the sink
in the softmax as one more column (tests/oracle.py), with autograd for every gradient.

fp64 throughout. Bound: both sides sum the same terms in another order (the ring merges partial
log-sum-exps, then rescales once); each value rests on chains of <= S + D + a few fp64 roundings, so
``64 * eps64`` relative to the largest entry leaves a wide margin while a missing or doubled sink
(an O(1) change of the denominator) or a wrong sink gradient sign is off by O(1e-2) or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringft.ops import zigzag_ring_attention
from ringft.ops.sharding import cp_shard, cp_unshard
from ringft.utils.spawn import run_distributed
from tests.oracle import sink_attention_fp64

BOUND = 64 * torch.finfo(torch.float64).eps
B, S, HQ, HKV, D = 2, 24, 4, 2, 8
# (window, documents): full causal, a window straddling chunk edges, packed documents, both
CASES = [(None, None), (5, None), (None, [[0, 7, 24], [0, 13, 17, 24]]), (9, [[0, 11, 24], [0, 24]])]


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=gen, dtype=torch.float64) * 2
    dout = torch.randn(B, S, HQ, D, generator=gen, dtype=torch.float64)
    return q, k, v, sinks, dout


def _oracle(case, seed):
    q, k, v, sinks, dout = _inputs(seed)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    out = sink_attention_fp64(q, k, v, sinks, window=case[0], cu_seqlens=case[1])
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _ring(case, seed, group, rank, size):
    q, k, v, sinks, dout = _inputs(seed)
    local = [cp_shard(t, rank, size).requires_grad_() for t in (q, k, v)]
    sinks.requires_grad_()
    out = zigzag_ring_attention(
        *local, group=group, backend="reference", sliding_window=case[0], cu_seqlens=case[1], sinks=sinks
    )
    out.backward(cp_shard(dout, rank, size))
    gathered = []
    for t in (out.detach(), *(x.grad for x in local)):
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        gathered.append(cp_unshard(parts))
    dist.all_reduce(sinks.grad, group=group)  # each rank holds the sum over its rows
    return gathered[0], [*gathered[1:], sinks.grad]


def _error(got, want) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


def test_sinks_on_one_rank_match_the_oracle():
    for i, case in enumerate(CASES):
        q, k, v, sinks, dout = _inputs(i)
        leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
        out = zigzag_ring_attention(
            q, k, v, backend="torch", sliding_window=case[0], cu_seqlens=case[1], sinks=sinks
        )
        out.backward(dout)
        want, grads = _oracle(case, i)
        assert _error([out.detach(), *(t.grad for t in leaves)], [want, *grads]) <= BOUND, case
        assert grads[3].abs().min() > 1e-3  # the sink gets a real gradient


def sinks_worker(rank: int, world: int) -> list[float]:
    errors = []
    for size in (2, 3, 4):
        group = dist.new_group(list(range(size)))
        if rank < size:
            for i, case in enumerate(CASES):
                out, grads = _ring(case, i, group, rank, size)
                want, want_grads = _oracle(case, i)
                errors.append(_error([out, *grads], [want, *want_grads]))
        dist.barrier()
    return errors


@pytest.mark.numerics
@pytest.mark.timeout(180)
def test_sinks_on_cp_2_to_4_match_the_oracle():
    for errors in run_distributed(sinks_worker, 4, timeout=150):
        assert errors and max(errors) <= BOUND, errors


def test_bad_sinks_are_refused():
    q, k, v, _, _ = _inputs(0)
    with pytest.raises(ValueError, match=r"one logit per query head \(4\), got \(2,\)"):
        zigzag_ring_attention(q, k, v, sinks=torch.zeros(2, dtype=torch.float64))
