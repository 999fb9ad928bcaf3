"""Latent attention (v head dim != q/k head dim) through the operator, against the fp64 oracle.

fp64. One rank with a window (the window ring pads the tensors); CP 1-4 on the plain ring and with
packed documents, where K and V travel at their own sizes: every message of the exchange is
k-size + v-size elements (counted by a patched exchange). The model-level comparison at CP 1-4 is
DeepSeek-V3 / Mistral 4 in tests/model/test_families.py. Bound: 64 eps64 relative, as
tests/ops/test_sinks.py (the same sums in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringft.ops import zigzag_ring_attention
from ringft.ops.sharding import cp_shard
from ringft.utils.spawn import run_distributed
from tests.oracle import full_attention_fp64, per_document_attention_fp64

BOUND = 64 * torch.finfo(torch.float64).eps


def test_v_narrower_or_wider_than_q_and_k_is_exact():
    gen = torch.Generator().manual_seed(0)
    for dqk, dv in ((24, 12), (8, 20)):
        q = torch.randn(2, 16, 4, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 16, 2, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 16, 2, dv, generator=gen, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, 16, 4, dv, generator=gen, dtype=torch.float64)
        out = zigzag_ring_attention(q, k, v, backend="torch", sliding_window=5)
        assert out.shape == (2, 16, 4, dv)
        got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
        from tests.oracle import windowed_attention_fp64

        ref = windowed_attention_fp64(q, k, v, 5)[0]
        want = [ref, *torch.autograd.grad(ref, (q, k, v), dout)]
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= BOUND * b.abs().max(), (dqk, dv)
        full = zigzag_ring_attention(q, k, v, backend="reference")
        assert (full - full_attention_fp64(q, k, v, True)[0]).abs().max() <= BOUND * full.abs().max()


SHAPES = ((24, 12), (8, 20))  # (dqk, dv): v narrower (DeepSeek-V3's 192 / 128) and wider
DOCS = [[0, 5, 19, 24]]  # packed documents across chunk edges


def _inputs(dqk: int, dv: int):
    gen = torch.Generator().manual_seed(dqk)
    shapes = ((1, 24, 4, dqk), (1, 24, 2, dqk), (1, 24, 2, dv), (1, 24, 4, dv))
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _oracle(dqk: int, dv: int, packed: bool) -> list[torch.Tensor]:
    q, k, v, dout = (x.requires_grad_() for x in _inputs(dqk, dv))
    ref = (per_document_attention_fp64(q, k, v, DOCS) if packed else full_attention_fp64(q, k, v, True))[0]
    return [ref.detach(), *torch.autograd.grad(ref, (q, k, v), dout)]


def latent_worker(rank: int, world: int) -> list[tuple]:
    """Per CP size, shape and layout: this rank's (out, dq, dk, dv) errors relative to the oracle's
    largest entry, and the element counts of every message it sent."""
    from ringft.ops.comm import RingExchange

    sent: list[int] = []
    start = RingExchange.start
    RingExchange.start = lambda self, t, buf=None: (sent.append(t.numel()), start(self, t, buf))[1]
    results = []
    for size in (1, 2, 3, 4):
        group = dist.new_group(list(range(size)))
        if rank >= size:
            continue
        for (dqk, dv), docs in [(shape, docs) for shape in SHAPES for docs in (None, DOCS)]:
            q, k, v, dout = (cp_shard(x, rank, size).requires_grad_() for x in _inputs(dqk, dv))
            sent.clear()
            out = zigzag_ring_attention(q, k, v, group=group, backend="torch", cu_seqlens=docs)
            got = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout.detach())]
            want = [cp_shard(w, rank, size) for w in _oracle(dqk, dv, docs is not None)]
            full = _oracle(dqk, dv, docs is not None)
            errors = [((a - b).abs().max() / f.abs().max()).item() for a, b, f in zip(got, want, full)]
            results.append((size, dqk, docs is not None, errors, list(sent), k.numel() + v.numel()))
    return results


@pytest.mark.timeout(300)
def test_k_and_v_travel_at_their_own_sizes_on_cp_1_to_4():
    for rank_results in run_distributed(latent_worker, 4, timeout=240):
        for size, dqk, packed, errors, sent, kv in rank_results:
            assert max(errors) <= BOUND, (size, dqk, packed, errors)
            # K/V: size - 1 hops forward and backward; dK/dV accumulators: size hops; each k + v elements
            assert sent == [kv] * (3 * (size - 1) + 1 if size > 1 else 0), (size, dqk, packed, sent)
